"""A server exposed the way docs/server.md's production section runs it: HTTPS with a certificate
made here, API keys from all three sources, CORS for one origin, a small body limit, the key
required on /metrics. Keys are checked on every /v1 route and never logged."""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

pytestmark = pytest.mark.timeout(300)

FLAG_KEY, FILE_KEY, ENV_KEY = "sk-flag-4f1c9e", "sk-file-77ab20", "sk-env-d03e5a"
WRONG_KEY = "sk-wrong-123456"
ORIGIN = "https://app.example.com"
MAX_REQUEST_BYTES = 64 * 1024
PROMPT_MARKER = "Tell me about the lighthouse keeper"


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "conveyor-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def secure(start_server, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("secure")
    cert, key = make_self_signed(tmp)
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# one key a line\n\n{FILE_KEY}\n")
    return start_server(
        ["--api-key", FLAG_KEY, "--api-key-file", str(key_file), "--metrics-require-key",
         "--allowed-origins", ORIGIN, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
         "--max-request-bytes", str(MAX_REQUEST_BYTES), "--log-level", "debug", "--log-prompts"],
        https_cert=cert, env={"CONVEYOR_API_KEY": ENV_KEY})


def client(server: Any, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=120, http_client=httpx.Client(verify=server.verify))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


CALLS = {
    "models": lambda c: c.models.list().data[0].id,
    "completions": lambda c: c.completions.create(model=None, prompt=PROMPT_MARKER,
                                                  max_tokens=2).choices[0].text,
    "chat": lambda c: c.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices[0],
    "completions-stream": lambda c: list(c.completions.create(
        model=None, prompt="Hi", max_tokens=2, stream=True)),
    "chat-stream": lambda c: list(c.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True)),
}
RAW = {"models": ("GET", "/v1/models", None),
       "completions": ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
       "chat": ("POST", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
       "completions-stream": ("POST", "/v1/completions",
                              {"prompt": "Hi", "max_tokens": 2, "stream": True}),
       "chat-stream": ("POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                        "stream": True})}


@pytest.mark.parametrize("route", list(CALLS))
def test_no_key_wrong_key_right_key(secure, route) -> None:
    method, path, body = RAW[route]
    resp = httpx.request(method, secure.base_url + path, json=body, verify=secure.verify,
                         timeout=60)
    assert resp.status_code == 401, resp.text
    err = resp.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"
    for header in ("Basic " + FLAG_KEY, FLAG_KEY, "Bearer", "Bearer " + FLAG_KEY[:-1]):
        resp = httpx.request(method, secure.base_url + path, json=body, verify=secure.verify,
                             headers={"Authorization": header}, timeout=60)
        assert resp.status_code == 401, header
    with pytest.raises(openai.AuthenticationError) as info:
        CALLS[route](client(secure, WRONG_KEY))
    assert info.value.status_code == 401
    assert CALLS[route](client(secure, FLAG_KEY))


def test_every_key_source_is_accepted(secure) -> None:
    for key in (FLAG_KEY, FILE_KEY, ENV_KEY):
        assert client(secure, key).models.list().data


def test_health_is_open_and_metrics_needs_the_key(secure) -> None:
    assert httpx.get(secure.base_url + "/health", verify=secure.verify).status_code == 200
    assert httpx.get(secure.base_url + "/metrics", verify=secure.verify).status_code == 401
    bad = httpx.get(secure.base_url + "/metrics", verify=secure.verify, headers=bearer(WRONG_KEY))
    assert bad.status_code == 401
    assert "conveyor:num_requests_running" in secure.metrics(headers=bearer(FILE_KEY))


def test_https_through_the_openai_client(secure) -> None:
    c = client(secure, FLAG_KEY)
    r = c.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hello"}],
                                  max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    # The same server is not trusted without its certificate, and does not speak plain HTTP.
    untrusting = openai.OpenAI(base_url=secure.base_url + "/v1", api_key=FLAG_KEY,
                               max_retries=0, timeout=30)
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()
    with pytest.raises(httpx.HTTPError):
        httpx.get(secure.base_url.replace("https://", "http://") + "/health", timeout=10)


def test_cors_preflight_allowed_for_the_listed_origin_only(secure) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(secure.base_url + "/v1/chat/completions", verify=secure.verify,
                             headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers":
                                      "authorization,content-type"})

    ok = preflight(ORIGIN)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = preflight("https://evil.example.com")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    call = httpx.get(secure.base_url + "/v1/models", verify=secure.verify,
                     headers={"Origin": ORIGIN, **bearer(FLAG_KEY)})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == ORIGIN
    # A refused key is still readable by the page, so it can tell the user why.
    denied = httpx.get(secure.base_url + "/v1/models", verify=secure.verify,
                       headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_closed_by_default(server) -> None:
    pre = httpx.options(server.base_url + "/v1/completions",
                        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.status_code != 200
    assert not any(h.startswith("access-control-") for h in pre.headers)
    call = httpx.get(server.base_url + "/v1/models", headers={"Origin": ORIGIN})
    assert call.status_code == 200
    assert not any(h.startswith("access-control-") for h in call.headers)


def test_oversized_body_is_413_before_it_is_read(secure) -> None:
    body = b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    url = secure.base_url + "/v1/completions"
    declared = httpx.post(url, content=body, verify=secure.verify, timeout=60,
                          headers={**bearer(FLAG_KEY), "content-type": "application/json"})

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    chunked = httpx.post(url, content=chunks(), verify=secure.verify, timeout=60,
                         headers={**bearer(FLAG_KEY), "content-type": "application/json"})
    assert "content-length" not in chunked.request.headers
    for resp in (declared, chunked):
        assert resp.status_code == 413, resp.text
        err = resp.json()["error"]
        assert str(MAX_REQUEST_BYTES) in err["message"] and err["code"] == "request_too_large"
    small = httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, verify=secure.verify,
                       headers=bearer(FLAG_KEY), timeout=60)
    assert small.status_code == 200


def test_default_body_limit(server) -> None:
    body = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    resp = httpx.post(server.base_url + "/v1/completions", content=body, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def _log_when(server: Any, predicate: Callable[[str], bool], timeout: float = 10.0) -> str:
    """The server's whole log once ``predicate(log)`` holds (an access line is written just
    after its response has been sent)."""
    deadline = time.monotonic() + timeout
    while True:
        log = server.log_path.read_text(errors="replace")
        if predicate(log) or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_access_log_and_no_key_in_logs(secure) -> None:
    c = client(secure, FLAG_KEY)
    r = c.completions.create(model=None, prompt=PROMPT_MARKER, max_tokens=3,
                             extra_body={"ignore_eos": True})
    list(c.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2, stream=True, extra_body={"ignore_eos": True}))
    with pytest.raises(openai.AuthenticationError):
        client(secure, WRONG_KEY).models.list()
    log = _log_when(secure, lambda text: r.id in text and '"GET /v1/models" 401' in text)
    line = next(line for line in log.splitlines() if r.id in line)
    assert '"POST /v1/completions" 200' in line
    assert f"prompt_tokens={r.usage.prompt_tokens}" in line and "output_tokens=3" in line
    assert "latency=" in line and PROMPT_MARKER in line  # --log-prompts
    assert any('"POST /v1/chat/completions" 200' in line and "output_tokens=2" in line
               for line in log.splitlines())
    for key in (FLAG_KEY, FILE_KEY, ENV_KEY, WRONG_KEY):
        assert key not in log


def test_access_log_leaves_prompts_out_by_default(server) -> None:
    marker = "A prompt that must stay out of the log"
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"prompt": marker, "max_tokens": 2, "ignore_eos": True}, timeout=60).json()
    log = _log_when(server, lambda text: r["id"] in text)
    line = next(line for line in log.splitlines() if r["id"] in line)
    assert '"POST /v1/completions" 200' in line and "output_tokens=2" in line
    assert marker not in log


def test_access_log_lines_cannot_be_forged(server) -> None:
    """The path is logged as it arrived (percent-encoded) and escaped: a %0A in a URL cannot
    start a line of its own, nor a quote end the request field."""
    forged = "2026-01-01 00:00:00,000 INFO conveyor.access: req-forged 1.2.3.4:1 \"GET /\" 200"
    resp = httpx.get(server.base_url + "/v1/models%0A" + quote(forged) + "%0D%22%5C", timeout=30)
    assert resp.status_code == 404
    log = _log_when(server, lambda text: "req-forged" in text)
    (line,) = [line for line in log.splitlines() if "req-forged" in line]
    assert ' "GET /v1/models%0A2026-01-01%2000' in line
    assert not any(line.startswith("2026-01-01") for line in log.splitlines())
    assert '%0D%22%5C" 404 ' in line


def test_https_stop_does_not_wait_for_an_idle_keep_alive(start_server, tmp_path) -> None:
    """A client holding an idle keep-alive connection does not hold up the TLS server's stop
    (a TLS close waits for the client's close_notify, which an idle client never sends)."""
    cert, key = make_self_signed(tmp_path)
    s = start_server(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], https_cert=cert)
    with httpx.Client(verify=s.verify) as idle:
        assert idle.get(s.base_url + "/health", timeout=30).status_code == 200
        start = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - start < 10, s.log()
