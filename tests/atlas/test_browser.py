"""The atlas in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium).

One browser for the module. Outside CI a missing browser skips these tests; under CI=true it fails them (CI
installs it, so a skip there would hide a broken run). Screenshots go to out/atlas-screens/ for people to
look at (not compared pixel by pixel: fonts differ between machines).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from kimik3.atlas.build import build_atlas
from kimik3.atlas.render import write_site
from kimik3.presets import load_config

pytestmark = pytest.mark.browser

SCREENS = Path(__file__).resolve().parents[2] / "out" / "atlas-screens"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


def _browser_or_skip():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium and driver:
        return chromium, driver
    msg = "needs chromium + chromium-driver (apt-get install chromium chromium-driver) and selenium"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI: {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    from kimik3.atlas.diff import diff_atlases
    from kimik3.atlas.live import load_and_run
    from kimik3.presets import DEMO_MODEL

    root = tmp_path_factory.mktemp("sites")
    atlases = {name: build_atlas(load_config(name), name=name) for name in ("k3", "tiny")}
    write_site(atlases["k3"], root / "k3")
    # tiny carries the extras: a diff page against k3 and live numbers from the demo model
    write_site(atlases["tiny"], root / "tiny", diff=diff_atlases(atlases["tiny"], atlases["k3"]),
               live=load_and_run(DEMO_MODEL, "ROMEO: But soft"))
    return root, atlases


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _browser_or_skip()
    profile = tempfile.mkdtemp(prefix="atlas-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver_path), options=opts)  # an explicit driver: nothing downloads
    d.set_window_size(1400, 1000)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def served(sites):
    root, _ = sites
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def open_page(browser, url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 20).until(lambda d: d.execute_script(
        "return document.readyState === 'complete' && (!window.katex || document.querySelectorAll('.tex').length"
        " === document.querySelectorAll('.tex .katex').length)"))


GEOMETRY_JS = """
const out = [];
for (const g of document.querySelectorAll('#diagram .node')) {
  const r = g.querySelector('rect').getBoundingClientRect();
  const w = +g.querySelector('rect').getAttribute('width');
  const texts = [...g.querySelectorAll('text')].map(t => t.getComputedTextLength());
  out.push({id: g.dataset.id, x: r.x, y: r.y, w: r.width, h: r.height, rectW: w, textW: Math.max(...texts)});
}
const badge = document.querySelector('#diagram .badge').getBoundingClientRect();
const svg = document.getElementById('diagram').getBoundingClientRect();
return {boxes: out, badge: [badge.width, badge.height], svg: [svg.width, svg.height]};
"""


@pytest.mark.parametrize("width", [1400, 1000])
def test_diagram_renders(browser, sites, width):
    root, atlases = sites
    browser.set_window_size(width, 1100)
    open_page(browser, (root / "k3" / "index.html").as_uri())
    geo = browser.execute_script(GEOMETRY_JS)
    boxes = geo["boxes"]
    leaves = {cid for cid, n in atlases["k3"]["nodes"].items() if n["leaf"]}
    assert leaves <= {b["id"] for b in boxes}
    assert geo["svg"][0] > 500 and all(b["w"] > 20 and b["h"] > 20 for b in boxes), geo["svg"]
    assert geo["badge"][0] > 0 and geo["badge"][1] > 0
    for i, a in enumerate(boxes):
        assert a["textW"] <= a["rectW"] - 4, a  # the box's text fits inside it (SVG units)
        for b in boxes[i + 1:]:
            overlap = (min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"]) > 1 and
                       min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"]) > 1)
            assert not overlap, (a["id"], b["id"])
    svg_text = browser.find_element("id", "diagram").text
    assert "×93" in svg_text and "KDA + latent MoE: 61 layers" in svg_text and "MLA + latent MoE: 24 layers" in svg_text
    SCREENS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENS / f"k3-index-{width}.png"))
    assert not errors(browser)
    browser.set_window_size(1400, 1000)


def test_hover_shows_the_summary(browser, sites):
    from selenium.webdriver.common.action_chains import ActionChains

    root, atlases = sites
    open_page(browser, (root / "k3" / "index.html").as_uri())
    tip = browser.find_element("id", "tip")
    assert not tip.is_displayed()
    node = browser.find_element("css selector", '#diagram .node[data-id="kda"]')
    ActionChains(browser).move_to_element(node).perform()
    assert tip.is_displayed() and atlases["k3"]["nodes"]["kda"]["summary"] in tip.text


def test_click_selects_and_opens_the_page(browser, sites):
    root, _ = sites
    open_page(browser, (root / "k3" / "index.html").as_uri())
    browser.find_element("css selector", '#diagram .node[data-id="shared_expert"]').click()
    assert browser.current_url.endswith("#sel=shared_expert")
    pane = browser.find_element("id", "p-shared_expert")
    assert pane.is_displayed() and "132,120,576" in pane.text and "92" in pane.text
    assert not browser.find_element("id", "p-kda").is_displayed()
    pane.find_element("css selector", "a.open").click()
    assert browser.current_url.endswith("c/shared_expert.html")
    assert browser.find_element("tag name", "h1").text == "Shared expert"
    crumbs = [a.text for a in browser.find_elements("css selector", "nav.crumbs a.crumb")]
    assert crumbs == ["93 decoder layers", "FFN", "92 Latent MoE layers", "Shared expert"]


def test_edge_label_opens_the_tensor_page(browser, sites):
    root, _ = sites
    open_page(browser, (root / "k3" / "index.html").as_uri())
    browser.find_element("css selector", '#diagram a.tensor[data-tensor="x_ffn"] text').click()
    assert browser.current_url.endswith("t/x_ffn.html")
    assert browser.find_element("id", "tensor-shape").text == "[N, D=7,168]"
    links = [a.get_attribute("href").rsplit("/", 1)[1] for a in browser.find_elements("css selector", "table a")]
    assert links == ["post_norm.html", "dense_mlp.html", "router.html", "latent_down.html", "shared_expert.html"]
    assert not errors(browser)


def test_url_keeps_the_selection(browser, sites):
    root, _ = sites
    open_page(browser, (root / "k3" / "index.html").as_uri() + "#sel=mla")

    def selected():
        return [g.get_attribute("data-id") for g in browser.find_elements("css selector", "#diagram .node.sel")]

    assert selected() == ["mla"] and browser.find_element("id", "p-mla").is_displayed()
    browser.find_element("css selector", '#diagram .node[data-id="router"]').click()
    assert selected() == ["router"] and browser.current_url.endswith("#sel=router")
    browser.back()
    assert browser.current_url.endswith("#sel=mla") and selected() == ["mla"]
    browser.forward()
    assert selected() == ["router"]


def test_keyboard_selects(browser, sites):
    from selenium.webdriver.common.keys import Keys

    root, _ = sites
    open_page(browser, (root / "k3" / "index.html").as_uri())
    node = browser.find_element("css selector", '#diagram .node[data-id="lm_head"]')
    browser.execute_script("arguments[0].focus()", node)
    node.send_keys(Keys.ENTER)
    assert browser.current_url.endswith("#sel=lm_head")


def test_formulas_render_and_link(browser, sites):
    root, _ = sites
    for page in ("index.html", "c/kda.html", "c/moe.html", "c/attn_mix.html"):
        open_page(browser, (root / "k3" / page).as_uri())
        tex = browser.find_elements("css selector", ".tex")
        assert tex and len(browser.find_elements("css selector", ".tex .katex")) == len(tex)
        assert not browser.find_elements("css selector", ".katex-error")
        body = browser.find_element("tag name", "body").text
        assert "\\htmlData" not in body and "\\frac" not in body and "\\mathrm" not in body, page
    open_page(browser, (root / "k3" / "index.html").as_uri() + "#sel=moe")
    browser.find_element("css selector", '#p-moe .tex [data-node="experts"]').click()
    assert browser.current_url.endswith("#sel=experts")
    assert browser.find_elements("css selector", '#p-moe .tex [data-node="experts"].lit')  # the symbol is lit
    assert [g.get_attribute("data-id") for g in browser.find_elements("css selector", "#diagram .node.sel")] == \
        ["experts"]


PANEL_TEX_JS = """
const out = [], panel = document.getElementById('panel');
for (const pane of panel.querySelectorAll('.pane')) {
  const was = pane.hidden;
  pane.hidden = false;
  for (const t of pane.querySelectorAll('.tex'))
    out.push({pane: pane.id, wide: t.scrollWidth > t.clientWidth + 1, overflowX: getComputedStyle(t).overflowX,
              panel: [panel.scrollWidth, panel.clientWidth]});
  pane.hidden = was;
}
return out;
"""


def test_wide_panel_formulas_scroll_inside_the_panel(browser, sites):
    """Each side-panel formula scrolls on its own when wider than the panel; the panel itself never overflows."""
    root, _ = sites
    open_page(browser, (root / "k3" / "index.html").as_uri())
    texs = browser.execute_script(PANEL_TEX_JS)
    assert texs and all(t["overflowX"] == "auto" for t in texs), texs
    assert any(t["wide"] for t in texs)  # the release's widest formulas exceed the 380 px panel
    assert all(t["panel"][0] <= t["panel"][1] + 1 for t in texs), [t for t in texs if t["panel"][0] > t["panel"][1]]


def test_component_page_accounting_and_evidence(browser, sites):
    root, atlases = sites
    for cid in ("kda", "experts", "attn_mix"):
        open_page(browser, (root / "k3" / "c" / f"{cid}.html").as_uri())
        counts = [int(td.get_attribute("data-count")) for td in
                  browser.find_elements("css selector", "#acct td[data-count]:not(#per-instance)")]
        per = int(browser.find_element("id", "per-instance").get_attribute("data-count"))
        stored = int(browser.find_element("id", "stored").get_attribute("data-count"))
        total = int(browser.find_element("id", "total").get_attribute("data-count"))
        assert sum(counts) == per and per * stored == total == atlases["k3"]["nodes"][cid]["total"]
        for ex in browser.find_elements("css selector", ".excerpt"):
            details = ex.find_element("xpath", "./..")
            if details.get_attribute("open") is None:
                details.find_element("tag name", "summary").click()
                assert details.get_attribute("open") is not None
            nums = [int(n) for n in browser.execute_script(
                "return [...arguments[0].querySelectorAll('.linenos')].map(s => s.textContent.trim())", ex) if n]
            assert nums[0] == int(ex.get_attribute("data-start")), (cid, nums[:3], ex.get_attribute("data-start"))
            assert nums[-1] == int(ex.get_attribute("data-end")), (cid, nums[-3:], ex.get_attribute("data-end"))
    open_page(browser, (root / "k3" / "c" / "attn_mix.html").as_uri())
    text = browser.find_element("tag name", "body").text
    assert "1,333,248" in text and "92 used" in text and "never read in layer 0" in text
    assert not errors(browser)


def test_diff_and_live_pages(browser, sites):
    root, atlases = sites
    open_page(browser, (root / "tiny" / "diff.html").as_uri())
    rows = browser.find_elements("css selector", "table.diff tr.sum td.num")
    total_a, total_b, delta = (int(td.text.replace(",", "")) for td in rows)
    assert (total_a, total_b) == (atlases["tiny"]["totals"]["total"], atlases["k3"]["totals"]["total"])
    assert delta == total_b - total_a
    open_page(browser, (root / "tiny" / "index.html").as_uri())
    live = browser.find_element("css selector", "section.live")
    assert "Expert load" in live.text and "AttnRes depth weights" in live.text and "KDA decay" in live.text
    assert len(live.find_elements("css selector", "table.heat")) == 3
    assert not errors(browser)


def test_served_sites_have_no_console_errors(browser, served, sites):
    for name in ("tiny", "k3"):
        for page in ("index.html#sel=attn_mix", "c/experts.html", "c/vision_block.html"):
            open_page(browser, f"{served}/{name}/{page}")
            assert browser.find_elements("css selector", ".tex .katex") or "vision_block" in page
            assert not errors(browser), (name, page)
    browser.set_window_size(1000, 1100)
    open_page(browser, f"{served}/tiny/index.html#sel=router")
    browser.save_screenshot(str(SCREENS / "tiny-index-1000.png"))
    browser.set_window_size(1400, 1000)
