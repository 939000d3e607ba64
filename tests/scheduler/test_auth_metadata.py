"""The credential on the wire: the `authorization` metadata, parsed and redacted (no network)."""

from __future__ import annotations

import pytest

from opentinker.auth import credential_from_metadata, metadata, parse_credential, redact

pytestmark = pytest.mark.unit
KEY = "otk_0123456789ab_" + "S" * 43


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"Bearer {KEY}", KEY),
        (f"bearer {KEY}", KEY),  # the scheme is case-insensitive (RFC 7235)
        (f"  BEARER   {KEY} ", KEY),
        (f"Basic {KEY}", ""),  # another scheme is no credential
        ("Bearer", ""),
        ("", ""),
    ],
)
def test_the_bearer_credential_is_read_from_the_metadata(header: str, expected: str) -> None:
    assert credential_from_metadata([("x-other", "1"), ("authorization", header)]) == expected


def test_what_the_client_sends_round_trips() -> None:
    assert credential_from_metadata(metadata(KEY)) == KEY
    assert metadata("") == ()


def test_kinds_prefixes_and_redaction() -> None:
    assert parse_credential(KEY) == ("user", "0123456789ab")
    assert parse_credential("otj_0123456789ab_" + "x" * 43)[0] == "job"
    assert parse_credential("otk_short_secret") is None
    text = redact(f"failed with key {KEY} at step 3")
    assert "S" * 43 not in text and "otk_0123456789ab_…" in text


@pytest.mark.parametrize("padded", [KEY + "\n", f"  {KEY}\r\n", f"\t{KEY} "])
def test_a_key_with_surrounding_whitespace_is_sent_stripped(padded: str) -> None:
    """A key read from a file keeps its newline (Path.read_text()); gRPC refuses a "\\n" in
    metadata before sending anything (INTERNAL: Invalid metadata), so it is stripped."""
    import opentinker

    assert credential_from_metadata(metadata(padded)) == KEY
    assert metadata(padded) == metadata(KEY)
    # Nobody listens on port 1: the call gets as far as connecting (UNAVAILABLE), no further.
    client = opentinker.Client("127.0.0.1:1", api_key=padded, timeout=2)
    with client, pytest.raises(opentinker.UnavailableError):
        client.whoami()
