-- Drives the opencomposer plugin's review and follow-ups in headless Neovim (see
-- test_nvim_review.py). Env: OC_PLUGIN, OC_ROOT, OC_PYTHON, OC_MODEL, OC_OUT.
vim.opt.runtimepath:prepend(os.getenv("OC_PLUGIN"))
vim.g.maplocalleader = ","
local root = os.getenv("OC_ROOT")
local out = { steps = {} }
local function finish()
  local f = io.open(os.getenv("OC_OUT"), "w")
  f:write(vim.fn.json_encode(out))
  f:close()
  vim.cmd("qall!")
end
local function step(name, ok)
  table.insert(out.steps, name .. "=" .. tostring(ok))
  if not ok then
    error("step failed: " .. name)
  end
end
local function lines(buf)
  return vim.api.nvim_buf_get_lines(buf, 0, -1, false)
end
local function marks(buf, ns)
  local got = {}
  for _, m in ipairs(vim.api.nvim_buf_get_extmarks(buf, ns, 0, -1, { details = true })) do
    local d = m[4]
    local virt = {}
    for _, l in ipairs(d.virt_lines or {}) do
      table.insert(virt, l[1][1] .. "|" .. l[1][2])
    end
    table.insert(got, {
      row = m[2],
      hl = d.hl_group,
      end_row = d.end_row,
      virt_lines = virt,
      above = d.virt_lines_above or false,
      hint = d.virt_text and d.virt_text[1][1] or nil,
    })
  end
  return got
end

out.errors = {}
vim.notify = function(msg, level)
  if level == vim.log.levels.ERROR then
    table.insert(out.errors, msg)
  end
end

local ok, err = pcall(function()
  local oc = require("opencomposer")
  oc.setup({
    cmd = { os.getenv("OC_PYTHON"), "-m", "opencomposer.server.lsp", "--stdio" },
    model = os.getenv("OC_MODEL"),
    root = root,
  })
  vim.cmd("edit " .. root .. "/calc.py")
  local calc = vim.api.nvim_get_current_buf()
  step("attached", vim.wait(30000, function()
    local c = vim.lsp.get_client_by_id(oc.state.client_id)
    return c ~= nil and c.initialized and vim.lsp.buf_is_attached(calc, oc.state.client_id)
  end, 20))

  -- 1. the agent edits two places in calc.py and one in test_calc.py
  vim.cmd("OpenComposerAsk fix add and mul")
  step("first", vim.wait(60000, function() return oc.state.last_result ~= nil end, 20))
  out.first = oc.state.last_result
  step("reviewing", vim.wait(5000, function()
    return oc.review.files["calc.py"] ~= nil and oc.review.files["test_calc.py"] ~= nil
  end, 20))
  out.calc_landed = lines(calc)
  out.hunks = oc.review.hunks("calc.py")
  out.marks = marks(calc, oc.review.ns)
  out.split = lines(oc.state.buf)

  -- <CR> on the split's "✎ calc.py" line opens the file at its first hunk
  local split_win = vim.fn.bufwinid(oc.state.buf)
  vim.api.nvim_set_current_win(split_win)
  for i, line in ipairs(lines(oc.state.buf)) do
    if line == "✎ calc.py" then
      vim.api.nvim_win_set_cursor(split_win, { i, 0 })
    end
  end
  vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes("<CR>", true, false, true), "x", false)
  out.opened = { vim.api.nvim_get_current_buf() == calc, vim.api.nvim_win_get_cursor(0)[1] }

  -- 2. reject the first hunk with the buffer-local mapping, accept the second by command
  vim.api.nvim_win_set_cursor(0, { 2, 0 })
  vim.api.nvim_feedkeys(",r", "x", false)
  out.after_reject = lines(calc)
  out.marks_after_reject = marks(calc, oc.review.ns)
  vim.cmd("normal ]h")
  out.cursor_after_jump = vim.api.nvim_win_get_cursor(0)[1]
  vim.cmd("OpenComposerAcceptHunk")
  out.after_accept = lines(calc)
  out.calc_settled = oc.review.files["calc.py"] == nil
  out.marks_after_accept = marks(calc, oc.review.ns)
  out.calc_modified = vim.bo[calc].modified
  out.calc_disk = vim.fn.readfile(root .. "/calc.py")

  -- 3. reject the whole of test_calc.py
  vim.cmd("edit " .. root .. "/test_calc.py")
  local test_buf = vim.api.nvim_get_current_buf()
  out.test_landed = lines(test_buf)
  vim.cmd("OpenComposerRejectFile")
  out.test_after_reject = lines(test_buf)
  step("decided", vim.wait(10000, function() return oc.review.quiet == 0 end, 20))
  vim.wait(300)

  -- 4. a follow-up continues the session; its edit is reviewed too
  vim.cmd("buffer " .. calc)
  oc.state.last_result = nil
  vim.cmd("OpenComposerAsk now document add")
  step("follow_up", vim.wait(60000, function() return oc.state.last_result ~= nil end, 20))
  out.second = oc.state.last_result
  step("reviewing_again", vim.wait(5000, function() return oc.review.files["calc.py"] ~= nil end, 20))
  out.hunks_follow_up = oc.review.hunks("calc.py")
  out.split_follow_up = lines(oc.state.buf)

  -- 5. undo the whole session: every file as before it, nothing left to review
  oc.undo()
  step("undone", vim.wait(20000, function() return oc.state.last_undo ~= nil end, 20))
  vim.wait(200)
  out.undo = oc.state.last_undo
  out.calc_after_undo = lines(calc)
  out.disk_after_undo = {
    calc = vim.fn.readfile(root .. "/calc.py"),
    test = vim.fn.readfile(root .. "/test_calc.py"),
  }
  out.review_left = vim.tbl_keys(oc.review.files)

  -- 6. a new session on request
  oc.state.last_result = nil
  vim.cmd("OpenComposerNew say hello")
  step("new", vim.wait(60000, function() return oc.state.last_result ~= nil end, 20))
  out.third = oc.state.last_result
  out.split_end = lines(oc.state.buf)
end)
if not ok then
  out.error = tostring(err)
end
finish()
