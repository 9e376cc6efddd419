import pytest

from hora.common.job.store import AuthenticationError, namespace_for, new_secret, sign, verify


def test_signed_values_verify_and_forgeries_are_rejected() -> None:
    secret = new_secret()
    blob = sign(secret, b"payload")
    assert verify(secret, blob) == b"payload"
    with pytest.raises(AuthenticationError, match="not signed with this job's secret"):
        verify(new_secret(), blob)
    with pytest.raises(AuthenticationError):
        verify(secret, blob[:-1] + b"X")
    with pytest.raises(AuthenticationError, match="too short"):
        verify(secret, b"short")


def test_namespace_depends_on_secret() -> None:
    a, b = new_secret(), new_secret()
    assert namespace_for(a) != namespace_for(b)
    assert a not in namespace_for(a)


def test_a_keyed_value_verifies_only_under_its_own_key() -> None:
    secret = new_secret()
    blob = sign(secret, b"payload", key="run/function")
    assert verify(secret, blob, key="run/function") == b"payload"
    with pytest.raises(AuthenticationError, match=r"for key 'run/result/0' \(it may have been"):
        verify(secret, blob, key="run/result/0")
    # Keyed and unkeyed signatures never stand in for each other.
    with pytest.raises(AuthenticationError):
        verify(secret, blob)
    with pytest.raises(AuthenticationError):
        verify(secret, sign(secret, b"payload"), key="run/function")
    # The key name is length-prefixed: ("a", "/bpayload") and ("a/b", "payload") sign different
    # bytes, so a tag cannot be reused by moving bytes between the key and the value.
    tag = sign(secret, b"/bpayload", key="a")[:32]
    with pytest.raises(AuthenticationError):
        verify(secret, tag + b"payload", key="a/b")
