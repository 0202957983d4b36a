"""The request encoders dispatch on a typed kind (RequestKind, AdminRequestKind); a kind's
protocol name (as docs/protocol.md spells it) is the same request."""

import pytest
from waltz import errors
from waltz._native import AdminRequestKind, RequestKind, encode_admin_request, encode_request

KEY = "00000000-0000-0000-0000-00000000000a"


def _members(kind):
    return {name: getattr(kind, name) for name in dir(kind) if name.isupper()}


def test_every_request_kind_encodes_as_its_protocol_name():
    members = _members(RequestKind)
    assert len(members) == 11
    for name, kind in members.items():
        args = dict(txid=7, max_count=3, low_water_mark=5, cluster_key=KEY, partition_count=4)
        assert encode_request(kind, 9, 2, 1, **args) == encode_request(name.lower(), 9, 2, 1, **args), name
    assert encode_request(RequestKind.RECORD, 1, 1, 0, txid=1) != encode_request(
        RequestKind.RECORD_HEADER, 1, 1, 0, txid=1
    )


def test_every_admin_request_kind_encodes_as_its_protocol_name():
    members = _members(AdminRequestKind)
    assert len(members) == 12
    for name, kind in members.items():
        args = dict(cluster_key=KEY, partition_count=4, txid=7, max_count=3, session_id=2, low_water_mark=5)
        assert encode_admin_request(kind, 2, 1, **args) == encode_admin_request(name.lower(), 2, 1, **args), name


def test_an_unknown_kind_name_is_refused():
    with pytest.raises(errors.InvalidArgumentError, match='unknown request kind "append"'):
        encode_request("append")
    with pytest.raises(errors.InvalidArgumentError, match='unknown admin request kind "last_session_info"'):
        encode_admin_request("last_session_info")
    with pytest.raises(errors.InvalidArgumentError, match="open needs cluster_key"):
        encode_request(RequestKind.OPEN)
