"""The embedded store's password files and pg_hba.conf (mesh/embedded/pgauth.py), without a
server: tests/test_attacks.py (the store) logs in with them against a real one."""

import os
from pathlib import Path

import pytest

from mesh.embedded import pgauth


def test_a_password_is_made_once_private_and_kept(tmp_path: Path) -> None:
    passwords = pgauth.Passwords(tmp_path / "store")
    assert not passwords.known("mesh")
    first = passwords.of("mesh")
    assert len(first) >= 32 and first.isascii()
    assert passwords.known("mesh") and passwords.of("mesh") == first
    assert os.stat(passwords.file("mesh")).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "store").st_mode & 0o777 == 0o700
    assert passwords.of("replicator") != first  # one per role


def test_a_password_file_that_cannot_be_used_is_named_never_shown(tmp_path: Path) -> None:
    passwords = pgauth.Passwords(tmp_path)
    passwords.file("mesh").write_text("pässwörd\n")
    with pytest.raises(pgauth.PasswordError) as said:
        passwords.of("mesh")
    assert str(passwords.file("mesh")) in str(said.value)
    assert "pässwörd" not in str(said.value)


def test_the_verifier_is_what_postgresql_stores() -> None:
    verifier = pgauth.verifier("secret")
    method, _, rest = verifier.partition("$")
    iterations, _, keys = rest.partition(":")
    salt, _, stored_and_server = keys.partition("$")
    assert (method, iterations) == ("SCRAM-SHA-256", "4096")
    assert salt and stored_and_server.count(":") == 1
    assert "'" not in verifier and "secret" not in verifier
    assert pgauth.verifier("secret") != verifier  # a fresh salt each time


def test_trust_is_found_and_replaced(tmp_path: Path) -> None:
    (tmp_path / "pg_hba.conf").write_text(
        "# local all all trust (a comment)\nhost all all 127.0.0.1/32 trust  # old mesh\n"
    )
    assert pgauth.trusting(tmp_path) and not pgauth.hba_is_ours(tmp_path)
    pgauth.write_hba(tmp_path)
    assert pgauth.hba_is_ours(tmp_path) and not pgauth.trusting(tmp_path)


def test_a_url_recorded_for_others_has_no_password() -> None:
    url = "postgresql://mesh:s3cret@127.0.0.1:5432,127.0.0.1:5433/mesh?target_session_attrs=any"
    assert pgauth.without_password(url) == (
        "postgresql://mesh@127.0.0.1:5432,127.0.0.1:5433/mesh?target_session_attrs=any"
    )
    assert pgauth.without_password("postgresql://127.0.0.1/mesh") == "postgresql://127.0.0.1/mesh"
