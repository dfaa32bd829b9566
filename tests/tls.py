"""Test certificates made in the test, with trustme: a CA, and a certificate it signed for
127.0.0.1 and localhost, written as PEM files (no openssl, nothing shared between tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

# The test extra installs trustme; a machine without it (the GPU machine's image, which runs
# only the tests marked gpu) skips the modules that need certificates instead of failing to
# collect them.
trustme = pytest.importorskip("trustme", reason="needs trustme: pip install -e '.[test]'")


def make_certificates(directory: Path) -> dict[str, str]:
    """Write ``ca.pem``, ``node.pem`` (the chain) and ``node.key`` in ``directory``; return
    their paths under ``"ca"``, ``"cert"`` and ``"key"``."""
    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1", "localhost")
    paths = {
        name: directory / file
        for name, file in (("ca", "ca.pem"), ("cert", "node.pem"), ("key", "node.key"))
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    for blob in node.cert_chain_pems:
        blob.write_to_path(str(paths["cert"]), append=True)
    node.private_key_pem.write_to_path(str(paths["key"]))
    return {name: str(path) for name, path in paths.items()}
