"""Review latency in Neovim: a hunk accepted or rejected until the buffer shows it.

Real headless Neovim with the plugin of `clients/nvim`, the real `opencomposer serve
--stdio` and the `scripted:` model. The agent edits a 2,000-line file in 40 places in
one turn; the edits land as `workspace/applyEdit` and show as 40 hunks. Then each
hunk is decided in turn, alternately rejected (the old lines go back into the buffer,
the buffer is written, the diff redrawn) and accepted (the hunk leaves the review,
the diff redrawn), timed inside Neovim around the call (`vim.loop.hrtime`): when it
returns, the buffer and its extmarks are what the user sees on the next redraw.

| figure | target |
|---|---|
| accept a hunk: review updated | < 100 ms |
| reject a hunk: buffer updated (and written) | < 100 ms |

Printed beside them: target/figure (above 1: met), the figure over a bare
`nvim_buf_set_lines` of the same size (the floor any plugin pays), the file's
settle (its `opencomposer.decide` round trip to the server), the CPU model and the
load average before and after.

    python benchmarks/editor_review.py [--lines 2000] [--hunks 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_MS = 100.0

DRIVER = r"""
vim.opt.runtimepath:prepend(os.getenv("OC_PLUGIN"))
local root, out = os.getenv("OC_ROOT"), { accept = {}, reject = {}, raw = {} }
local function ms(t0) return (vim.loop.hrtime() - t0) / 1e6 end
local ok, err = pcall(function()
  local oc = require("opencomposer")
  oc.setup({ cmd = { os.getenv("OC_PYTHON"), "-m", "opencomposer.server.lsp", "--stdio" },
             model = os.getenv("OC_MODEL"), root = root })
  vim.cmd("edit " .. root .. "/big.py")
  local buf = vim.api.nvim_get_current_buf()
  assert(vim.wait(60000, function()
    local c = vim.lsp.get_client_by_id(oc.state.client_id)
    return c ~= nil and c.initialized and vim.lsp.buf_is_attached(buf, oc.state.client_id)
  end, 10), "server did not start")
  local t0 = vim.loop.hrtime()
  vim.cmd("OpenComposerAsk edit everything")
  assert(vim.wait(120000, function() return oc.state.last_result ~= nil end, 5), "no answer")
  out.ask_ms = ms(t0)
  assert(vim.wait(10000, function() return oc.review.files["big.py"] ~= nil end, 5), "no review")
  out.hunks = #oc.review.hunks("big.py")
  local scratch = vim.api.nvim_create_buf(false, true)
  vim.api.nvim_buf_set_lines(scratch, 0, -1, false, vim.api.nvim_buf_get_lines(buf, 0, -1, false))
  local i = 0
  while oc.review.files["big.py"] ~= nil and #oc.review.hunks("big.py") > 0 do
    i = i + 1
    local row = 2 * i -- the raw floor: one line replaced in a copy of the file
    local r0 = vim.loop.hrtime()
    vim.api.nvim_buf_set_lines(scratch, row, row + 1, false, { "x = 1" })
    table.insert(out.raw, ms(r0))
    local last = #oc.review.hunks("big.py") == 1
    if last then out.settle_t0 = vim.loop.hrtime() end
    local h0 = vim.loop.hrtime()
    if i % 2 == 1 then
      oc.review.reject_hunk("big.py", 1)
      table.insert(out.reject, ms(h0))
    else
      oc.review.accept_hunk("big.py", 1)
      table.insert(out.accept, ms(h0))
    end
  end
  assert(vim.wait(20000, function() return oc.review.quiet == 0 end, 1), "decide unanswered")
  out.settle_ms = ms(out.settle_t0)
  out.settle_t0 = nil
end)
if not ok then out.error = tostring(err) end
local f = io.open(os.getenv("OC_OUT"), "w"); f:write(vim.fn.json_encode(out)); f:close()
vim.cmd("qall!")
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def workspace(root: Path, lines: int, hunks: int) -> list[str]:
    """A file of `lines` lines and one turn that edits `hunks` places of it."""
    body = [f"value_{i} = compute({i}, {i * 7 % 13})" for i in range(lines)]
    (root / "big.py").write_text("\n".join(body) + "\n")
    step = lines // hunks
    calls = [
        f'<edit_file path="big.py">\n<old>{body[k * step + step // 2]}</old>\n'
        f"<new>{body[k * step + step // 2]}  # reviewed {k}\nextra_{k} = {k}</new>\n</edit_file>"
        for k in range(hunks)
    ]
    return ["Editing.\n" + "\n".join(calls), "Done."]


def stats(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return f"p50 {statistics.median(values):7.2f}  p95 {p95:7.2f}  max {values[-1]:7.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--hunks", type=int, default=40)
    args = parser.parse_args(argv)
    if shutil.which("nvim") is None:
        print("editor_review: needs nvim (apt-get install neovim)", file=sys.stderr)
        return 2
    version = subprocess.run(["nvim", "--version"], capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="oc-review-") as tmp:
        tmp_path = Path(tmp)
        root = tmp_path / "repo"
        root.mkdir()
        turns = workspace(root, args.lines, args.hunks)
        model = tmp_path / "turns.json"
        model.write_text(json.dumps({"turns": turns, "chars_per_second": 0}))
        driver, out = tmp_path / "driver.lua", tmp_path / "out.json"
        driver.write_text(DRIVER)
        env = dict(os.environ)
        env.update(
            OC_PLUGIN=str(REPO / "clients" / "nvim"),
            OC_ROOT=str(root),
            OC_PYTHON=sys.executable,
            OC_MODEL=f"scripted:{model}",
            OC_OUT=str(out),
            OPENCOMPOSER_HOME=str(tmp_path / "home"),
            HOME=str(tmp_path),
        )
        load_before = os.getloadavg()
        subprocess.run(
            ["nvim", "--headless", "--clean", "-n", "-u", str(driver)],
            env=env,
            cwd=root,
            capture_output=True,
            timeout=600,
        )
        load_after = os.getloadavg()
        got = json.loads(out.read_text()) if out.exists() else {"error": "no output"}
    if "error" in got:
        print(f"editor_review: {got['error']}", file=sys.stderr)
        return 1
    raw = statistics.median(got["raw"])
    print(f"Neovim review latency ({version.splitlines()[0]}), {args.lines}-line file,")
    print(f"{got['hunks']} hunks from one agent turn (ask to answer {got['ask_ms']:.0f} ms)")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs")
    print(
        f"load average (1/5/15 min) {' '.join(f'{x:.2f}' for x in load_before)} before,"
        f" {' '.join(f'{x:.2f}' for x in load_after)} after"
    )
    print(f"{'figure (ms)':<34} {'':40} target/p50  p50/raw set_lines")
    for name, key in (
        ("accept a hunk: review updated", "accept"),
        ("reject a hunk: buffer updated", "reject"),
    ):
        values = got[key]
        p50 = statistics.median(values)
        print(f"{name:<34} {stats(values)}   {TARGET_MS / p50:8.1f}  {p50 / raw:10.1f}")
    print(f"{'raw nvim_buf_set_lines (floor)':<34} p50 {raw:7.3f}")
    print(f"{'settle: decide round trip':<34} {got['settle_ms']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
