"""The portable state format: round trips, what the archive holds, and every error."""

from __future__ import annotations

import contextlib
import io
import json
import re
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import akv
from akv.errors import (
    InvalidArgumentError,
    MixedKeyKindsError,
    OptimizerError,
    StateFormatError,
)
from akv.optimizer import (
    DCASGD,
    FTML,
    FTRL,
    LAMB,
    LARS,
    NAG,
    SGD,
    STATE_FORMAT_NAME,
    STATE_FORMAT_VERSION,
    AdaDelta,
    AdaGrad,
    Adam,
    Adamax,
    AdamW,
    CosineScheduler,
    GroupAdaGrad,
    MultiFactorScheduler,
    Nadam,
    RMSProp,
    Signum,
    Updater,
    decode_states,
    encode_states,
    from_config,
    get_updater,
)

OPTIMIZERS = {
    "sgd": lambda: SGD(learning_rate=0.1, wd=0.01),
    "sgd-momentum": lambda: SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
    "nag": lambda: NAG(learning_rate=0.1, momentum=0.9, wd=0.01),
    "signum": lambda: Signum(wd_lh=0.01),
    "adam": lambda: Adam(learning_rate=0.01, wd=0.01),
    "adagrad": lambda: AdaGrad(),
    "rmsprop": lambda: RMSProp(),
    "rmsprop-centered": lambda: RMSProp(centered=True),
    "adadelta": lambda: AdaDelta(),
    "ftrl": lambda: FTRL(),
    "lamb": lambda: LAMB(wd=0.01),
    "adam-scheduled": lambda: Adam(
        learning_rate=None, lr_scheduler=CosineScheduler(max_update=6, warmup_steps=2)
    ),
    "ftml": lambda: FTML(wd=0.01),
    "adamax": lambda: Adamax(wd=0.01),
    "nadam": lambda: Nadam(wd=0.01),  # its shared momentum schedule, too
    "adamw": lambda: AdamW(wd=0.01),
    "dcasgd": lambda: DCASGD(),
    "dcasgd-momentum": lambda: DCASGD(momentum=0.9, wd=0.01),
    "lars": lambda: LARS(eta=0.1),
    "lars-momentum-scheduled": lambda: LARS(  # its shared last learning rate, too
        momentum=0.9,
        eta=0.1,
        lr_scheduler=MultiFactorScheduler(step=[2, 4, 5], factor=0.5, base_lr=0.1),
    ),
    "groupadagrad": lambda: GroupAdaGrad(),
    "sgd-float16": lambda: SGD(learning_rate=0.1, momentum=0.9, multi_precision=True),
    "adam-float16": lambda: Adam(multi_precision=True),
}

RNG = np.random.default_rng(7)
GRADS = [RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(3)]


def drive(updater, keys, grads, weights):
    for grad in grads:
        for key in keys:
            updater(key, grad.astype(weights[key].dtype), weights[key])


def trees_equal(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and len(a) == len(b) and all(map(trees_equal, a, b))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_reloaded_updater_makes_exactly_the_next_update(name):
    dtype = np.float16 if name.endswith("float16") else np.float32
    keys = [0, 5]
    original = get_updater(OPTIMIZERS[name]())
    weights = {k: np.linspace(-1, 1, 12).reshape(3, 4).astype(dtype) for k in keys}
    drive(original, keys, GRADS[:2], weights)
    data = original.dump_states()

    restored = get_updater(OPTIMIZERS[name]())
    restored.load_states(data)
    copies = {k: w.copy() for k, w in weights.items()}
    drive(original, keys, GRADS[2:], weights)
    drive(restored, keys, GRADS[2:], copies)
    for key in keys:
        np.testing.assert_array_equal(copies[key], weights[key])
        assert trees_equal(restored.states[key], original.states[key])
    assert restored.optimizer.num_update == original.optimizer.num_update


def test_dump_optimizer_carries_the_config_and_loading_replaces_the_optimizer():
    original = get_updater(Adam(learning_rate=0.05, beta1=0.8, wd=0.1))
    weights = {"w": np.ones((3, 4), np.float32)}
    drive(original, ["w"], GRADS[:2], weights)
    restored = get_updater(SGD())
    restored.load_states(original.dump_states(dump_optimizer=True))
    assert isinstance(restored.optimizer, Adam)
    assert restored.optimizer.get_config() == original.optimizer.get_config()
    copy = {"w": weights["w"].copy()}
    drive(original, ["w"], GRADS[2:], weights)
    drive(restored, ["w"], GRADS[2:], copy)
    np.testing.assert_array_equal(copy["w"], weights["w"])


def test_update_counts_and_num_update_are_restored():
    original = get_updater(Adam(begin_num_update=2))
    weights = {0: np.ones(2, np.float32), 1: np.ones(2, np.float32)}
    drive(original, [0], [np.ones(2, np.float32)] * 3, weights)
    drive(original, [1], [np.ones(2, np.float32)], weights)
    restored = get_updater(Adam())
    restored.load_states(original.dump_states())
    assert dict(restored.optimizer.index_update_counts) == {0: 5, 1: 3}
    assert restored.optimizer.num_update == 5


def test_states_can_be_encoded_without_an_updater():
    states = {"a": (np.arange(3.0), None, [np.ones((2, 2), np.float16)]), "b": None}
    data = encode_states(states, index_update_counts={"a": 4, "b": 1}, num_update=4)
    saved = decode_states(data)
    assert saved.states.keys() == states.keys()
    assert trees_equal(saved.states["a"], states["a"]) and saved.states["b"] is None
    assert (saved.index_update_counts, saved.num_update) == ({"a": 4, "b": 1}, 4)
    assert saved.optimizer_config is None


def test_shared_state_is_saved_and_optional():
    data = encode_states({0: None}, shared_state={"m_schedule": 0.25, "cur_lr": None})
    assert decode_states(data).shared_state == {"m_schedule": 0.25, "cur_lr": None}
    assert decode_states(encode_states({0: None})).shared_state == {}
    # a file from before shared_state existed
    assert decode_states(archive(good_structure(), GOOD_MEMBERS)).shared_state == {}


@pytest.mark.parametrize("bad", [{"m": float("inf")}, {"m": "0.5"}, {1: 0.5}, [("m", 0.5)]])
def test_a_shared_state_that_is_not_names_to_numbers_cannot_be_encoded(bad):
    with pytest.raises(InvalidArgumentError, match="shared_state"):
        encode_states({0: None}, shared_state=bad)


class Counting(SGD):
    """An optimizer with a shared state (SGD's update, and a count of all updates)."""

    _SHARED_STATE = ("total",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = 0.0

    def _step(self, index, weight, grad, state, lr, wd):
        self.total += 1
        super()._step(index, weight, grad, state, lr, wd)


def test_an_updater_saves_and_restores_its_optimizers_shared_state():
    original = get_updater(Counting())
    drive(original, [0, 1], GRADS[:2], {k: np.ones((3, 4), np.float32) for k in (0, 1)})
    restored = get_updater(Counting())
    restored.load_states(original.dump_states())
    assert restored.optimizer.shared_state() == {"total": 4.0}


def test_a_shared_state_the_optimizer_does_not_keep_is_refused_and_changes_nothing():
    updater = get_updater(SGD())
    updater.states[0] = None
    data = get_updater(Counting()).dump_states()
    with pytest.raises(StateFormatError, match=r"SGD: shared state \['total'\] is not kept"):
        updater.load_states(data)
    assert updater.states == {0: None}
    with pytest.raises(OptimizerError, match="must be finite"):
        Counting().restore_shared_state({"total": float("nan")})


def test_decoded_arrays_are_writeable_copies():
    weight = np.ones(3, np.float32)
    saved = decode_states(encode_states({0: weight}))
    saved.states[0][0] = 5.0
    assert weight[0] == 1.0 and saved.states[0].flags.writeable


def test_the_archive_is_an_npz_numpy_reads_without_pickle():
    data = encode_states({7: (np.arange(4, dtype=np.float32), None)}, num_update=1)
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        assert sorted(archive.files) == ["a0", "structure.json"]
        np.testing.assert_array_equal(archive["a0"], np.arange(4, dtype=np.float32))
    structure = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("structure.json"))
    assert structure["format"] == STATE_FORMAT_NAME
    assert structure["version"] == STATE_FORMAT_VERSION
    assert (structure["key_kind"], structure["keys"]) == ("int", [7])
    assert structure["states"] == [{"tuple": [{"array": "a0", "shape": [4], "dtype": "<f4"}, None]}]


def test_the_same_states_are_the_same_bytes_whenever_they_are_saved(monkeypatch):
    """No time of writing in the archive: checkpoints of equal states compare equal."""
    import time

    states = {"emb": (np.arange(6, dtype=np.float32).reshape(2, 3), None)}
    saved = []
    for now in (1.7e9, 1.7e9 + 3601.5):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        saved.append(encode_states(states, index_update_counts={"emb": 2}, num_update=2))
    assert saved[0] == saved[1]
    members = zipfile.ZipFile(io.BytesIO(saved[0])).infolist()
    assert {info.date_time for info in members} == {(1980, 1, 1, 0, 0, 0)}


def test_str_keys_come_back_as_str():
    saved = decode_states(encode_states({"3": None}, index_update_counts={"3": 1}))
    assert list(saved.states) == ["3"] and saved.index_update_counts == {"3": 1}


def test_encoding_keys_of_both_kinds_is_an_error():
    with pytest.raises(MixedKeyKindsError):
        encode_states({1: None, "1": None})


@pytest.mark.parametrize(
    "state",
    [{"m": np.ones(2)}, 3.0, np.array([object()]), np.zeros(2, dtype=[("a", "f4")])],
    ids=["dict", "float", "object-array", "structured-array"],
)
def test_a_state_the_format_cannot_hold_is_an_invalid_argument(state):
    with pytest.raises(InvalidArgumentError, match="cannot be saved"):
        encode_states({0: state})


def test_decoding_something_not_bytes_is_an_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="must be bytes"):
        decode_states("states")


def archive(structure, members=None, raw=None):
    """A zip holding ``structure`` as JSON and ``members`` as .npy files."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        if structure is not None:
            zf.writestr("structure.json", raw if raw is not None else json.dumps(structure))
        for name, array in (members or {}).items():
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array)
    return buffer.getvalue()


def good_structure(**changes):
    structure = {
        "format": STATE_FORMAT_NAME,
        "version": STATE_FORMAT_VERSION,
        "key_kind": "int",
        "keys": [0],
        "states": [{"array": "a0", "shape": [2], "dtype": "<f4"}],
        "index_update_counts": [[0, 1]],
        "num_update": 1,
        "optimizer": None,
    }
    structure.update(changes)
    return structure


GOOD_MEMBERS = {"a0": np.zeros(2, np.float32)}


def test_the_hand_built_archive_of_these_tests_decodes():
    assert decode_states(archive(good_structure(), GOOD_MEMBERS)).num_update == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a zip at all", "not an akv state archive: File is not a zip file"),
        (b"", "not an akv state archive: File is not a zip file"),
        (b"x" * 1000, "not an akv state archive: File is not a zip file"),
        (archive(None, GOOD_MEMBERS), "no 'structure.json' member"),
        (archive({}, raw="{not json"), "unreadable structure.json"),
        (archive([1, 2]), "not a JSON object"),
        (archive({}, raw='{"num_update": 1e999}'), "unreadable structure.json"),
        (archive({}, raw='{"num_update": NaN}'), "unreadable structure.json"),
        (archive({}, raw="[" * 100_000 + "]" * 100_000), "unreadable structure.json"),
        (archive(good_structure(format="mxnet-pickle"), GOOD_MEMBERS), "format 'mxnet-pickle'"),
        (archive(good_structure(version=2), GOOD_MEMBERS), "version 2 is not supported"),
        (archive({k: v for k, v in good_structure().items() if k != "num_update"}), "lacks"),
        (archive(good_structure(key_kind="bytes"), GOOD_MEMBERS), "key_kind 'bytes'"),
        (archive(good_structure(keys=["0"]), GOOD_MEMBERS), "not a int key"),
        (archive(good_structure(keys=[0, 1]), GOOD_MEMBERS), "not lists of one length"),
        (archive(good_structure(keys=[0, 0], states=[None, None])), "appears twice"),
        (archive(good_structure(), {}), "no member a0.npy"),
        (archive(good_structure(), {"a0": np.zeros(3, np.float32)}), "holds shape (3,)"),
        (archive(good_structure(), {"a0": np.zeros(2, np.float64)}), "dtype float64"),
        (
            archive(good_structure(states=[{"array": "a0", "shape": [2], "dtype": "O"}])),
            "not a numeric dtype",
        ),
        (archive(good_structure(states=[{"dict": []}]), GOOD_MEMBERS), "malformed"),
        (
            archive(
                good_structure(
                    states=[{"tuple": [good_structure()["states"][0]] * 2}],
                ),
                GOOD_MEMBERS,
            ),
            "used twice",
        ),
        (archive(good_structure(num_update=-1), GOOD_MEMBERS), "bad num_update"),
        (archive(good_structure(index_update_counts=[[0]]), GOOD_MEMBERS), "[key, count]"),
        (archive(good_structure(index_update_counts=[[0, 1.5]]), GOOD_MEMBERS), "update count"),
        (archive(good_structure(optimizer=[1]), GOOD_MEMBERS), "neither a config nor null"),
        (archive(good_structure(shared_state=[1]), GOOD_MEMBERS), "'shared_state' is not"),
        (
            archive(good_structure(shared_state={"m": "one"}), GOOD_MEMBERS),
            "'shared_state' is not",
        ),
        (archive(good_structure(shared_state={"m": True}), GOOD_MEMBERS), "'shared_state' is not"),
    ],
    ids=lambda v: v if isinstance(v, str) else "archive",  # no bytes: ids stay stable
)
def test_bad_archives_raise_state_format_error_saying_what_is_wrong(data, message):
    with pytest.raises(StateFormatError, match=re.escape(message)):
        decode_states(data)


@pytest.mark.parametrize("content", [b"", b"garbage", b"x" * 1000])
def test_a_file_that_is_not_an_archive_says_so_as_bytes_do_not_how_zipfile_seeks(tmp_path, content):
    path = tmp_path / "states"
    path.write_bytes(content)
    with akv.create("local") as kv:
        kv.set_optimizer(SGD())
        with pytest.raises(StateFormatError) as info:
            kv.load_optimizer_states(path)
    assert (
        str(info.value) == "optimizer states are not an akv state archive: File is not a zip file"
    )


def test_a_member_larger_than_declared_is_refused_before_it_is_read():
    data = archive(good_structure(), {"a0": np.zeros(100_000, np.float32)})
    with pytest.raises(StateFormatError, match="too large"):
        decode_states(data)


def test_a_compressed_npz_is_refused():
    buffer = io.BytesIO()
    np.savez_compressed(buffer, a0=np.zeros(2, np.float32))
    with zipfile.ZipFile(buffer, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("structure.json", json.dumps(good_structure()))
    with pytest.raises(StateFormatError, match="compressed or encrypted"):
        decode_states(buffer.getvalue())


def test_a_loaded_state_of_the_wrong_shape_fails_at_the_next_update():
    updater = get_updater(SGD(momentum=0.9))
    updater.load_states(encode_states({0: np.zeros(3, np.float32)}))
    with pytest.raises(StateFormatError, match=r"index 0 does not fit.*shape \(2,\)"):
        updater(0, np.ones(2, np.float32), np.ones(2, np.float32))


def test_a_loaded_state_of_another_optimizer_fails_at_the_next_update():
    adam = get_updater(Adam())
    adam(0, np.ones(2, np.float32), np.ones(2, np.float32))
    sgd = get_updater(SGD())
    sgd.load_states(adam.dump_states())
    with pytest.raises(StateFormatError, match="expected no state, got a tuple of 2"):
        sgd(0, np.ones(2, np.float32), np.ones(2, np.float32))


def test_a_saved_config_that_cannot_be_rebuilt_is_a_state_format_error():
    data = encode_states({}, optimizer_config={"name": "no-such-optimizer", "params": {}})
    with pytest.raises(StateFormatError, match="cannot be rebuilt"):
        get_updater(SGD()).load_states(data)


def test_a_failed_load_changes_nothing():
    updater = get_updater(SGD(momentum=0.9))
    weight = np.ones(2, np.float32)
    updater(0, np.ones(2, np.float32), weight)
    before_states, before_optimizer = updater.states, updater.optimizer
    with pytest.raises(StateFormatError):
        updater.load_states(b"garbage")
    assert updater.states is before_states and updater.optimizer is before_optimizer
    assert dict(updater.optimizer.index_update_counts) == {0: 1}


def test_dumping_an_updater_with_both_key_kinds_is_an_error():
    updater = Updater(SGD())
    updater(0, np.ones(1, np.float32), np.ones(1, np.float32))
    updater("0", np.ones(1, np.float32), np.ones(1, np.float32))
    with pytest.raises(MixedKeyKindsError):
        updater.dump_states()


def test_a_config_in_the_archive_rebuilds_the_same_optimizer():
    optimizer = LAMB(lower_bound=0.1, param_idx2name={0: "w_bias"})
    saved = decode_states(encode_states({}, optimizer_config=optimizer.get_config()))
    assert from_config(saved.optimizer_config).get_config() == optimizer.get_config()


arrays = st.builds(
    lambda shape, dtype, seed: np.random.default_rng(seed).standard_normal(shape).astype(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([np.float16, np.float32, np.float64, np.int64, np.bool_]),
    st.integers(0, 2**32 - 1),
)
trees = st.recursive(
    st.none() | arrays,
    lambda children: st.lists(children, max_size=3) | st.lists(children, max_size=3).map(tuple),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.integers(-5, 5), trees, max_size=4)
    | st.dictionaries(st.text(max_size=5), trees, max_size=4)
)
def test_any_state_tree_survives_a_round_trip(states):
    saved = decode_states(encode_states(states))
    assert list(saved.states) == list(states)
    for key, state in states.items():
        assert trees_equal(saved.states[key], state)


VALID = encode_states({0: (np.arange(6, dtype=np.float32), None)}, index_update_counts={0: 2})


@settings(max_examples=150, deadline=None)
@given(
    st.binary(max_size=400)
    | st.builds(
        lambda at, value: VALID[:at] + bytes([value]) + VALID[at + 1 :],
        st.integers(0, len(VALID) - 1),
        st.integers(0, 255),
    )
)
def test_corrupt_bytes_raise_state_format_error_or_decode(data):
    # Anything but a clean decode or StateFormatError (an IndexError, a zlib error...) fails.
    with contextlib.suppress(StateFormatError):
        decode_states(data)
