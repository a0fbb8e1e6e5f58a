"""HTTP keep-alive: the server outlasts clients' idle expiry, so no request goes out on a connection being closed."""
import httpx
import pytest

from osd.errors import InvalidArgument
from osd.serve.settings import ServeSettings, http_config
from osd_bench.serve_load import KEEPALIVE_EXPIRY, _client


def test_server_keeps_idle_connections_past_the_clients_own_expiry():
    """osd serve's keep-alive outlasts httpx's (and the openai client's) 5 s idle expiry, and the bench's client drops
    idle connections before any server closes them: no request is sent on a connection closing at that instant."""
    config = http_config(lambda *a: None, ServeSettings())
    assert config.timeout_keep_alive == 30 > httpx.Limits().keepalive_expiry
    assert _client("http://x", None, 1.0, 4)._transport._pool._keepalive_expiry == KEEPALIVE_EXPIRY < 5
    with pytest.raises(InvalidArgument):
        ServeSettings(keep_alive=0)
