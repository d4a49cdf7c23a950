"""The dashboard: its JSON (admin only), its figures per interval, and the page in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from testkit.service import LoopThread

from http_api.app import build_app
from http_api.server import HttpServer
from reprise.server.dashboard import StatsHistory, dashboard_router, interval_point
from reprise.server.metrics import ServiceMetrics
from serving.admin import TenantInfo, TenantStats
from serving.records import Principal
from serving.savings import Savings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ADMIN = "rpa_admin_key"


class KeyTable:
    def __init__(self) -> None:
        self.keys = {ADMIN: Principal("admin", "k1"), "rpk_tenant": Principal("tenant", "a" * 32)}

    def authenticate(self, key: str) -> Principal | None:
        return self.keys.get(key)


def stats(tid: str, steps: int, drafted: int, accepted: int, mix: dict, index: int) -> TenantStats:
    # Each step took 0.05 s; plain steps would have taken 0.04 s per committed token, and cached prompt
    # tokens save 0.5 s per 10 steps.
    savings = Savings(decode_seconds=0.05 * steps, plain_decode_seconds=0.04 * (steps + accepted),
                      prefill_seconds=0.1 * steps, plain_prefill_seconds=0.15 * steps, num_tokens=steps + accepted)
    return TenantStats(tid, index_tokens=index, index_sequences=3, index_memory_bytes=index * 20,
                       num_requests=steps // 10, num_steps=steps, num_drafted_steps=drafted,
                       num_draft_tokens=drafted * 8, num_accepted_tokens=accepted,
                       acceptance_by_position=(0.9, 0.7, 0.5, 0.3, 0.2), drafter_steps=mix, savings=savings)


def test_interval_point_uses_differences() -> None:
    a = stats("t", 100, 50, 100, {"suffix": 50}, 10)
    b = stats("t", 200, 130, 300, {"suffix": 90, "corpus": 40}, 20)
    p = interval_point(a, b, 10.0)
    assert p["hit_rate"] == pytest.approx(0.8) and p["tau"] == pytest.approx(3.0)
    assert p["drafter_mix"] == pytest.approx({"suffix": 0.5, "corpus": 0.5})
    # The interval: 100 steps in 5 + 10 s, 300 tokens; without Reprise 0.04 * 300 + 15 s.
    assert p["speedup"] == pytest.approx((0.04 * 300 + 15) / 15)
    assert p["seconds_saved"] == pytest.approx(0.04 * 300 + 15 - 15)
    assert p["tokens_per_second"] == pytest.approx(300 / 15)
    idle = interval_point(b, b, 20.0)
    assert idle["hit_rate"] is None and idle["tau"] is None and idle["drafter_mix"] == {}
    assert idle["speedup"] is None and idle["seconds_saved"] == 0


@pytest.fixture
def dashboard():
    current: list[TenantStats] = []
    tenants = [TenantInfo("a" * 32, "acme"), TenantInfo("b" * 32, "globex")]
    history = StatsHistory(lambda: list(current), lambda: tenants, interval_s=10)
    t = 1_700_000_000.0
    for k in range(8):  # a tenant whose hit rate and tau rise as its history grows, and a quiet one
        current[:] = [
            stats("a" * 32, 100 * k, 100 * k * k // 16, 150 * k * k // 4,
                  {"suffix": 60 * k * k // 16, "corpus": 40 * k * k // 16}, 1000 * (k + 1)),
            stats("b" * 32, 30 * k, 5 * k, 6 * k, {"suffix": 5 * k}, 300),
        ]
        history.sample(t + 10 * k)
    metrics = ServiceMetrics()
    loop = LoopThread()
    server = HttpServer("127.0.0.1", 0)
    auth = KeyTable()
    app = build_app(None, auth, metrics.render, lambda service="": "serving", routers=[dashboard_router(auth, history.snapshot)])
    loop.call(server.start(app))
    yield server, history
    loop.call(server.stop())
    loop.close()


def get(url: str, key: str | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers  # case-insensitive, as HTTP header names are
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def test_json_needs_an_admin_key(dashboard) -> None:
    server, _ = dashboard
    base = f"http://127.0.0.1:{server.port}"
    assert get(base + "/dashboard/api/stats")[0] == 401
    code, body, _ = get(base + "/dashboard/api/stats", "wrong")
    assert code == 401 and b"not accepted" in body
    code, body, _ = get(base + "/dashboard/api/stats", "rpk_tenant")
    assert code == 403 and b"admin key" in body
    code, body, _ = get(base + "/dashboard/api/stats", ADMIN)
    doc = json.loads(body)
    assert code == 200 and [t["name"] for t in doc["tenants"]] == ["acme", "globex"]
    assert len(doc["tenants"][0]["series"]) == 7
    acme = doc["tenants"][0]["current"]
    assert acme["speedup"] == pytest.approx((0.04 * (700 + 150 * 49 // 4) + 0.15 * 700) / (0.15 * 700))
    assert acme["seconds_saved"] == pytest.approx(acme["seconds_saved_drafts"] + acme["seconds_saved_cache"])
    assert acme["seconds_saved_cache"] == pytest.approx(0.05 * 700)
    code, page, headers = get(base + "/dashboard")
    assert code == 200 and b"<svg" in page
    assert b"<script src" not in page and b"<link" not in page and b"@import" not in page  # nothing external
    assert "script-src 'nonce-" in headers["Content-Security-Policy"]
    assert get(base + "/metrics")[0] == 401  # per-tenant activity shows in its deltas: admins only
    assert get(base + "/metrics", "rpk_tenant")[0] == 403
    code, text, _ = get(base + "/metrics", ADMIN)
    assert code == 200 and b"reprise_spec_decode_num_drafts_total" in text
    assert get(base + "/healthz")[0] == 200 and get(base + "/nope")[0] == 404


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_draws_its_charts_in_headless_chromium(dashboard, tmp_path: Path) -> None:
    server, _ = dashboard
    url = f"http://127.0.0.1:{server.port}/dashboard#key={ADMIN}"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars", "--virtual-time-budget=5000"]
    dom = subprocess.run(flags + [f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=False)
    assert 'data-ready="1"' in dom.stdout, dom.stderr[-2000:]
    for chart in ("hit-rate", "tau", "speedup", "drafter-mix", "acceptance", "index-size"):
        part = dom.stdout.split(f'data-chart="{chart}"', 1)[1].split("</svg>", 1)[0]
        points = int(part.split('data-points="', 1)[1].split('"', 1)[0])
        assert points > 0, chart
    assert dom.stdout.count('class="line"') >= 7  # hit rate, tau, speedup, acceptance: x2 (minus idle gaps)
    assert '<path d="M' in dom.stdout.split('data-chart="speedup"', 1)[1].split("</svg>", 1)[0]
    acme = dom.stdout.split('<tr data-tenant="' + "a" * 32 + '">', 1)[1].split("</tr>", 1)[0]
    cells = [c.split(">", 1)[1] for c in acme.split("</td>")[:-1]]
    assert cells[12] == "1.97×" and cells[13] == "1.7 min" and cells[-1] == "24.2"  # speedup, time saved, tokens/s
    assert "acme" in dom.stdout and "globex" in dom.stdout and "2 tenant(s)" in dom.stdout
    shot = tmp_path / "dashboard.png"
    subprocess.run(flags + [f"--user-data-dir={tmp_path / 'profile-shot'}", "--window-size=1280,1400",
                            f"--screenshot={shot}", url], capture_output=True, timeout=120, check=False)
    assert shot.is_file() and shot.stat().st_size > 20_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
@pytest.mark.parametrize(("key", "says"), [("rpk_tenant", "belongs to a tenant"), ("rpa_mistyped", "was not accepted")])
def test_page_with_a_key_it_cannot_use_says_why(dashboard, tmp_path: Path, key: str, says: str) -> None:
    server, _ = dashboard
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'p'}", "--virtual-time-budget=3000", "--dump-dom",
                          f"http://127.0.0.1:{server.port}/dashboard#key={key}"],
                         capture_output=True, text=True, timeout=120, check=False).stdout
    assert "admin key needed" in dom and says in dom
