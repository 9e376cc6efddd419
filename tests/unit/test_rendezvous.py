import pytest

from hora.common.rendezvous import AuthenticationError, namespace_for, new_secret, sign, verify


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
