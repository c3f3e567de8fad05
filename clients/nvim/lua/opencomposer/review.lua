-- Review of the agent's edits, as Cursor does it: the edits land in the buffers at
-- once (LSP workspace/applyEdit); here each edited file shows as a diff against its
-- baseline (the text before the agent's first edit to it still under review):
-- added lines highlighted (DiffAdd), removed lines as virtual lines (DiffDelete)
-- where they were, a hint at each hunk. Accept keeps a hunk (it moves into the
-- baseline); reject puts the baseline's lines back into the buffer. A file with no
-- hunk left is settled: the server records the decision (`opencomposer.decide`:
-- accept when any hunk was kept, else reject, which also deletes a file the
-- session created). Works on Neovim 0.7 (vim.diff, extmarks with virt_lines).
--
-- init.lua feeds it: `snapshot(path)` before an agent edit is applied, `promote(
-- session_id, path)` on the session's `edit` event; and gives it `decide` and
-- `write` (save a buffer the agent's edit had saved).

local R = {}

R.ns = vim.api.nvim_create_namespace("opencomposer_review")
R.files = {} -- path -> {session_id, baseline = {lines}, accepted, rejected, created}
R.pending = {} -- path -> {baseline, created}: snapshot taken, edit event not yet seen
R.quiet = 0 -- >0 while our own decide/undo runs: the edits it brings are reverts
R.root = ""
R.keys = {}
R.decide = function(_, _, _) end -- (session_id, path, decision)
R.write = function(_, _) end -- (bufnr, was_clean)
R.on_change = nil -- called after every review change (tests, statuslines)

local api = vim.api
local diff = (vim.text and vim.text.diff) or vim.diff -- vim.diff before Neovim 0.11

local function fname(path)
  return R.root .. "/" .. path
end

local function bufnr_of(path)
  local buf = vim.fn.bufnr(fname(path))
  if buf ~= -1 and api.nvim_buf_is_loaded(buf) then
    return buf
  end
  return nil
end

-- The workspace-relative path of a file name (nil outside the workspace).
function R.rel(name)
  if name:sub(1, #R.root + 1) == R.root .. "/" then
    return name:sub(#R.root + 2)
  end
  return nil
end

function R.path_of(buf)
  return R.rel(api.nvim_buf_get_name(buf))
end

local function shown(lhs)
  if not lhs or lhs == "" then
    return nil
  end
  local leader = vim.g.maplocalleader or "\\"
  return (lhs:gsub("<[lL]ocal[lL]eader>", function()
    return leader
  end))
end

local function text(lines)
  if #lines == 0 or (#lines == 1 and lines[1] == "") then
    return ""
  end
  return table.concat(lines, "\n") .. "\n"
end

local function slice(lines, first, count)
  local out = {}
  for i = first, first + count - 1 do
    table.insert(out, lines[i])
  end
  return out
end

-- The hunks of `path` now: {a, na, b, nb} with a and b the first line (1-based) of
-- the baseline's and the buffer's side (for an empty side, the line after which).
function R.hunks(path)
  local f, buf = R.files[path], bufnr_of(path)
  if not f or not buf then
    return {}
  end
  local out = {}
  local current = api.nvim_buf_get_lines(buf, 0, -1, false)
  for _, h in ipairs(diff(text(f.baseline), text(current), { result_type = "indices" })) do
    local na, nb = h[2], h[4]
    table.insert(out, {
      a = na > 0 and h[1] or h[1] + 1,
      na = na,
      b = nb > 0 and h[3] or h[3] + 1,
      nb = nb,
    })
  end
  return out
end

-- -- drawing ---------------------------------------------------------------------

function R.render(path, hunks)
  local buf = bufnr_of(path)
  if not buf then
    return
  end
  api.nvim_buf_clear_namespace(buf, R.ns, 0, -1)
  local f = R.files[path]
  if not f then
    return
  end
  hunks = hunks or R.hunks(path)
  local last = api.nvim_buf_line_count(buf) - 1
  for i, h in ipairs(hunks) do
    if h.nb > 0 then -- the added lines, whole width
      api.nvim_buf_set_extmark(buf, R.ns, h.b - 1, 0, {
        end_row = h.b - 1 + h.nb,
        end_col = 0,
        hl_group = "DiffAdd",
        hl_eol = true,
        priority = 150,
      })
    end
    local removed = {}
    for _, line in ipairs(slice(f.baseline, h.a, h.na)) do
      table.insert(removed, { { line, "DiffDelete" } })
    end
    -- removed lines stand where they were: above the hunk's new lines, or below the
    -- line they followed (above the first line when they were the file's start)
    local row, above = h.b - 1, true
    if h.nb == 0 and h.b > 1 then
      row, above = h.b - 2, false
    end
    row = math.max(0, math.min(row, last))
    local hint = string.format(
      " opencomposer %d/%d: %s accept · %s reject ",
      i,
      #hunks,
      shown(R.keys.accept_hunk) or ":OpenComposerAcceptHunk",
      shown(R.keys.reject_hunk) or ":OpenComposerRejectHunk"
    )
    local mark = { virt_text = { { hint, "Comment" } }, virt_text_pos = "eol" }
    if #removed > 0 then
      mark.virt_lines, mark.virt_lines_above = removed, above
    end
    api.nvim_buf_set_extmark(buf, R.ns, row, 0, mark)
  end
end

-- -- tracking ----------------------------------------------------------------------

-- Before an agent edit to `path` is applied: remember its text, unless under review.
function R.snapshot(path, created)
  if R.quiet > 0 or R.files[path] or R.pending[path] then
    return
  end
  local baseline = {}
  if not created then
    local buf = vim.fn.bufadd(fname(path))
    vim.fn.bufload(buf)
    baseline = api.nvim_buf_get_lines(buf, 0, -1, false)
  end
  R.pending[path] = { baseline = baseline, created = created }
end

local function map(buf)
  local actions = {
    accept_hunk = R.accept_hunk_at,
    reject_hunk = R.reject_hunk_at,
    accept_file = function()
      R.accept_file(R.path_of(0))
    end,
    reject_file = function()
      R.reject_file(R.path_of(0))
    end,
    next_hunk = function()
      R.jump(1)
    end,
    prev_hunk = function()
      R.jump(-1)
    end,
  }
  for name, fn in pairs(actions) do
    local lhs = R.keys[name]
    if lhs and lhs ~= "" then
      vim.keymap.set("n", lhs, fn, { buffer = buf, desc = "opencomposer: " .. name:gsub("_", " ") })
    end
  end
  local group = api.nvim_create_augroup("opencomposer_review_" .. buf, { clear = true })
  api.nvim_create_autocmd({ "TextChanged", "TextChangedI" }, {
    group = group,
    buffer = buf,
    callback = function()
      local path = R.path_of(buf)
      if path then
        R.render(path)
      end
    end,
  })
end

local function unmap(buf)
  for _, lhs in pairs(R.keys) do
    if lhs and lhs ~= "" then
      pcall(vim.keymap.del, "n", lhs, { buffer = buf })
    end
  end
  pcall(api.nvim_del_augroup_by_name, "opencomposer_review_" .. buf)
end

local function changed()
  if R.on_change then
    R.on_change()
  end
end

-- The session's `edit` event for `path`: the snapshot becomes a review.
function R.promote(session_id, path)
  local snap = R.pending[path]
  if snap and not R.files[path] then
    R.pending[path] = nil
    R.files[path] = {
      session_id = session_id,
      baseline = snap.baseline,
      created = snap.created,
      accepted = 0,
      rejected = 0,
    }
    local buf = bufnr_of(path)
    if buf then
      map(buf)
    end
  end
  R.render(path)
  changed()
end

function R.forget(path)
  R.files[path] = nil
  local buf = bufnr_of(path)
  if buf then
    api.nvim_buf_clear_namespace(buf, R.ns, 0, -1)
    unmap(buf)
  end
end

function R.forget_session(session_id)
  for path, f in pairs(R.files) do
    if f.session_id == session_id then
      R.forget(path)
    end
  end
  changed()
end

-- No hunk left: the server records the file's decision.
local function settle(path)
  local f = R.files[path]
  local hunks = f and R.hunks(path) or {}
  if #hunks > 0 then
    R.render(path, hunks)
    changed()
    return
  end
  if not f then
    return
  end
  R.forget(path)
  R.decide(f.session_id, path, f.accepted > 0 and "accept" or "reject")
  changed()
end

-- -- decisions ---------------------------------------------------------------------

function R.accept_hunk(path, index)
  local f, h = R.files[path], R.hunks(path)[index]
  if not f or not h then
    return false
  end
  local current = api.nvim_buf_get_lines(bufnr_of(path), 0, -1, false)
  local baseline = slice(f.baseline, 1, h.a - 1)
  vim.list_extend(baseline, slice(current, h.b, h.nb))
  vim.list_extend(baseline, slice(f.baseline, h.a + h.na, #f.baseline - (h.a + h.na) + 1))
  f.baseline = baseline
  f.accepted = f.accepted + 1
  settle(path)
  return true
end

function R.reject_hunk(path, index)
  local f, h, buf = R.files[path], R.hunks(path)[index], bufnr_of(path)
  if not f or not h or not buf then
    return false
  end
  local clean = not vim.bo[buf].modified
  api.nvim_buf_set_lines(buf, h.b - 1, h.b - 1 + h.nb, false, slice(f.baseline, h.a, h.na))
  f.rejected = f.rejected + 1
  R.write(buf, clean)
  settle(path)
  return true
end

-- The hunk under the cursor (a removal: on the line it followed).
function R.hunk_at(path, row)
  for i, h in ipairs(R.hunks(path)) do
    local first = h.nb > 0 and h.b or math.max(h.b - 1, 1)
    local last = h.nb > 0 and h.b + h.nb - 1 or first
    if row >= first and row <= last then
      return i
    end
  end
  return nil
end

local function at_cursor(action)
  local path = R.path_of(0)
  local index = path and R.files[path] and R.hunk_at(path, api.nvim_win_get_cursor(0)[1])
  if not index then
    vim.notify("opencomposer: no agent change under the cursor", vim.log.levels.WARN)
    return false
  end
  return action(path, index)
end

function R.accept_hunk_at()
  return at_cursor(R.accept_hunk)
end

function R.reject_hunk_at()
  return at_cursor(R.reject_hunk)
end

function R.accept_file(path)
  local f = path and R.files[path]
  if not f then
    return false
  end
  f.baseline = api.nvim_buf_get_lines(bufnr_of(path), 0, -1, false)
  f.accepted = f.accepted + 1
  settle(path)
  return true
end

-- Every hunk of the file rejected here, in the buffer (hunks accepted before stay).
function R.reject_file(path)
  local f, buf = path and R.files[path], path and bufnr_of(path)
  if not f or not buf then
    return false
  end
  local clean = not vim.bo[buf].modified
  api.nvim_buf_set_lines(buf, 0, -1, false, f.baseline)
  f.rejected = f.rejected + 1
  R.write(buf, clean)
  settle(path)
  return true
end

function R.accept_all()
  for _, path in ipairs(vim.tbl_keys(R.files)) do
    R.accept_file(path)
  end
end

function R.reject_all()
  for _, path in ipairs(vim.tbl_keys(R.files)) do
    R.reject_file(path)
  end
end

-- ]h / [h: the next (or previous) hunk in this buffer, wrapping around.
function R.jump(step)
  local path = R.path_of(0)
  local hunks = path and R.hunks(path) or {}
  if #hunks == 0 then
    return
  end
  local row = api.nvim_win_get_cursor(0)[1]
  local starts = {}
  for _, h in ipairs(hunks) do
    table.insert(starts, math.max(1, h.nb > 0 and h.b or h.b - 1))
  end
  local target = step > 0 and starts[1] or starts[#starts]
  for i = 1, #starts do
    local s = step > 0 and starts[i] or starts[#starts + 1 - i]
    if (step > 0 and s > row) or (step < 0 and s < row) then
      target = s
      break
    end
  end
  api.nvim_win_set_cursor(0, { target, 0 })
end

-- Every hunk under review, for the quickfix list.
function R.items()
  local items = {}
  local paths = vim.tbl_keys(R.files)
  table.sort(paths)
  for _, path in ipairs(paths) do
    for i, h in ipairs(R.hunks(path)) do
      table.insert(items, {
        filename = fname(path),
        lnum = math.max(1, h.nb > 0 and h.b or h.b - 1),
        text = string.format("hunk %d: +%d -%d (session %s)", i, h.nb, h.na, R.files[path].session_id),
      })
    end
  end
  return items
end

return R
