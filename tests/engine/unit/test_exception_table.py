"""The native exceptions are declared once (rust/src/python/errors.rs); `waltz.errors` and the
stub take their lists from that table through scripts/gen_exceptions.py."""

import importlib.util
import pathlib

import waltz._native as native
import waltz.errors as errors

SCRIPT = pathlib.Path(__file__).parents[3] / "scripts" / "gen_exceptions.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_exceptions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_match_the_native_table():
    stale = _generator().stale()
    assert not stale, f"run scripts/gen_exceptions.py: out of date: {sorted(map(str, stale))}"


def test_the_table_is_the_hierarchy_waltz_errors_exports():
    names = [name for name, _, _ in native.EXCEPTIONS]
    assert len(names) == len(set(names)) == 22
    for name, base, doc in native.EXCEPTIONS:
        cls = getattr(native, name)
        assert getattr(errors, name) is cls
        assert name in errors.__all__
        assert cls.__bases__[0].__name__ == base
        assert cls.__doc__ == doc
        assert issubclass(cls, errors.WaltzError)
    assert errors.WaltzError.__bases__ == (Exception,)


def test_every_engine_error_kind_reaches_python_as_its_class(tmp_path):
    """A few kinds raised for real, each caught as the class the table maps it to."""
    key = "00000000-0000-0000-0000-000000000001"
    with native.Storage.create(tmp_path / "s", key, 2) as s:
        try:
            native.Storage.create(tmp_path / "s", key, 2)
        except errors.StorageExistsError as e:
            assert str(tmp_path / "s") in str(e)
        else:
            raise AssertionError("creating over a storage directory must fail")
        try:
            s.partition(7)
        except errors.PartitionNotFoundError:
            pass
        else:
            raise AssertionError("partition 7 of 2 must not exist")
    try:
        native.Storage.open(tmp_path / "nothing-here")
    except errors.NotInitialisedError:
        pass
    else:
        raise AssertionError("opening a missing storage directory must fail")
