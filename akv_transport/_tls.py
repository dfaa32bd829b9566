"""TLS contexts for akv's servers and clients: TLS is one option away.

Both ask for TLS 1.2 at least and verify the peer's certificate against a CA (a client
always; a server when given one, for mutual TLS). They only build :class:`ssl.SSLContext`
objects: :func:`akv_transport.serve`, :class:`akv_transport.HttpClient` and
:func:`akv_transport.open_stream` take them.
"""

from __future__ import annotations

import ssl

__all__ = ["client_ssl_context", "server_ssl_context"]


def server_ssl_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a server; with ``ca``, clients must present a certificate it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if ca:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a client that trusts ``ca``; ``cert``/``key`` for mutual TLS."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert and key:
        context.load_cert_chain(cert, key)
    return context
