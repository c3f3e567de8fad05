-- opencomposer for Neovim: the agent of `opencomposer serve` inside the editor.
--
--   require("opencomposer").setup{}            -- starts the server for the cwd
--   :OpenComposerAsk fix the failing test      -- or select lines, then :'<,'>OpenComposerAsk
--   :OpenComposerAsk and add a test            -- a follow-up: the same session, history kept
--   :OpenComposerNew [query]                   -- the next request starts a new session
--   :OpenComposerCancel   :OpenComposerSearch retry logic   :OpenComposerUndo
--   :OpenComposerAcceptHunk / RejectHunk / AcceptFile / RejectFile / AcceptAll / RejectAll
--   :OpenComposerReview                        -- every change under review, in the quickfix list
--
-- The session streams into a split (the agent's prose, tool calls as one line each);
-- the agent's edits arrive as LSP workspace/applyEdit and land in buffers at once
-- (u undoes them); buffers that had no unsaved changes are written, so the agent's
-- commands see the new text. Each edited buffer then shows the change as a diff to
-- review (review.lua): accept or reject per hunk, per file, or everything.
-- Commands that need approval are offered through vim.ui.select.
-- Works on Neovim 0.7 and later (only 0.7 APIs are used).

local review = require("opencomposer.review")

local M = {}
M.review = review

local defaults = {
  cmd = { "opencomposer", "serve", "--stdio" },
  model = nil, -- a --model spec; nil: the server's default
  root = nil, -- workspace folder; nil: the current directory
  approve = "safe", -- none | safe | all
  auto_apply_edits = true, -- under safe, file changes land as buffer edits (u undoes) without asking
  save_edits = true, -- write buffers the agent changed if they had no unsaved changes
  split = "botright vsplit", -- how the session window opens
  autostart = true,
  -- buffer-local mappings while a buffer has changes under review ("" or false: none)
  keys = {
    accept_hunk = "<localleader>a",
    reject_hunk = "<localleader>r",
    accept_file = "<localleader>A",
    reject_file = "<localleader>R",
    next_hunk = "]h",
    prev_hunk = "[h",
  },
}

M.config = vim.deepcopy(defaults)
M.state = {
  client_id = nil,
  session_id = nil, -- the latest session
  conversation = nil, -- the session the next request continues (nil: a new one)
  running = {}, -- session_id -> true while it runs
  queued = {}, -- decisions on files of a running session: {session_id, path, decision}
  results = {}, -- session_id -> the ask result
  buf = nil, -- the session buffer
}

local EMPTY = vim.empty_dict()
local NEW_API = vim.fn.has("nvim-0.11") == 1 -- client methods take self; start_client is deprecated

local function start_client(config)
  if NEW_API then
    return vim.lsp.start(config, { attach = false })
  end
  return vim.lsp.start_client(config)
end

local function client_call(c, name, ...)
  if NEW_API then
    return c[name](c, ...)
  end
  return c[name](...)
end

local function notify(msg, level)
  vim.notify("opencomposer: " .. msg, level or vim.log.levels.INFO)
end

-- -- the session split ---------------------------------------------------------

-- <CR> on a "✎ path" line of the split: that file, at its first change under review.
function M.open_edit()
  local line = vim.api.nvim_get_current_line()
  local path = line:match("^✎ (.+)$")
  if not path then
    return false
  end
  local others = vim.tbl_filter(function(w)
    return w ~= vim.api.nvim_get_current_win() and vim.api.nvim_win_get_config(w).relative == ""
  end, vim.api.nvim_tabpage_list_wins(0))
  if #others > 0 then
    vim.api.nvim_set_current_win(others[1])
  end
  vim.cmd("edit " .. vim.fn.fnameescape(M.config.root .. "/" .. path))
  local first = review.hunks(path)[1]
  if first then
    vim.api.nvim_win_set_cursor(0, { math.max(1, first.nb > 0 and first.b or first.b - 1), 0 })
  end
  return true
end

local function session_buf()
  local buf = M.state.buf
  if buf and vim.api.nvim_buf_is_valid(buf) then
    return buf
  end
  buf = vim.api.nvim_create_buf(false, true)
  vim.api.nvim_buf_set_name(buf, "opencomposer://session")
  vim.bo[buf].filetype = "opencomposer"
  vim.bo[buf].bufhidden = "hide"
  vim.keymap.set("n", "<CR>", M.open_edit, { buffer = buf, desc = "opencomposer: open the edited file" })
  vim.keymap.set("n", "q", "<cmd>close<CR>", { buffer = buf, desc = "opencomposer: close the session window" })
  M.state.buf = buf
  return buf
end

local function show_split()
  local buf = session_buf()
  for _, win in ipairs(vim.api.nvim_list_wins()) do
    if vim.api.nvim_win_get_buf(win) == buf then
      return
    end
  end
  local current = vim.api.nvim_get_current_win()
  vim.cmd(M.config.split)
  vim.api.nvim_win_set_buf(0, buf)
  vim.api.nvim_set_current_win(current)
end

local function append(lines, continue_last)
  local buf = session_buf()
  local count = vim.api.nvim_buf_line_count(buf)
  local last = vim.api.nvim_buf_get_lines(buf, count - 1, count, false)[1] or ""
  if continue_last then
    lines[1] = last .. lines[1]
    vim.api.nvim_buf_set_lines(buf, count - 1, count, false, lines)
  elseif count == 1 and last == "" then
    vim.api.nvim_buf_set_lines(buf, 0, 1, false, lines)
  else
    vim.api.nvim_buf_set_lines(buf, count, count, false, lines)
  end
  for _, win in ipairs(vim.api.nvim_list_wins()) do
    if vim.api.nvim_win_get_buf(win) == buf then
      vim.api.nvim_win_set_cursor(win, { vim.api.nvim_buf_line_count(buf), 0 })
    end
  end
end

local function brief(args)
  local parts = {}
  for k, v in pairs(args or {}) do
    local s = type(v) == "string" and v or vim.inspect(v)
    s = s:gsub("\n.*", "…")
    if #s > 60 then
      s = s:sub(1, 60) .. "…"
    end
    table.insert(parts, k .. "=" .. s)
  end
  table.sort(parts)
  return table.concat(parts, " ")
end

-- Render one opencomposer/event (docs/lsp.md) into the split.
function M.render(ev)
  local t = ev.type
  if t == "session_start" then
    M.state.session_id = ev.session_id
    M.state.running[ev.session_id] = true
    if (ev.request or 1) > 1 then
      append({ "", "## follow-up " .. ev.request .. " in session " .. ev.session_id, "" })
    else
      append({ "", "# session " .. ev.session_id .. " (" .. tostring(ev.model) .. ")", "" })
    end
  elseif t == "model_delta" then
    -- prose: the reply without its tool-call XML (the calls render as ▶ lines)
    local piece = type(ev.prose) == "string" and ev.prose or ev.text
    if piece ~= "" then
      append(vim.split(piece, "\n", { plain = true }), true)
    end
  elseif t == "model_end" then
    append({ "" })
  elseif t == "message" and type(ev.text) == "string" and ev.text:sub(1, 1) == "[" then
    append({ ev.text })
  elseif t == "tool_start" then
    append({ "▶ " .. ev.name .. " " .. brief(ev.args) })
  elseif t == "tool_end" then
    local mark = ev.status == "ok" and "✓" or "✗"
    append({ string.format("  %s %s %.2fs", mark, ev.name, ev.duration_s or 0) })
  elseif t == "edit" then
    local lines = vim.split(ev.diff or "", "\n", { plain = true })
    table.insert(lines, 1, "✎ " .. ev.path)
    append(lines)
    review.promote(ev.session_id, ev.path)
  elseif t == "session_end" then
    M.state.running[ev.session_id] = nil
    M.flush_decisions(ev.session_id)
    append({
      string.format("— %s: %d turns, %d tool calls, %.1fs", ev.status, ev.turns or 0, ev.tool_calls or 0, ev.duration_s or 0),
      "  trace " .. tostring(ev.trace),
    })
  end
end

-- -- handlers for server requests ----------------------------------------------

local function uri_set(edit)
  local uris = {}
  for _, change in ipairs(edit.documentChanges or {}) do
    if change.textDocument then
      uris[change.textDocument.uri] = true
    elseif change.uri then
      uris[change.uri] = true
    end
  end
  for uri, _ in pairs(edit.changes or {}) do
    uris[uri] = true
  end
  return uris
end

-- Write `bufnr` if it had no unsaved changes before ours (save_edits), and tell the
-- server it is saved (noautocmd skips the LSP hook).
local function write(bufnr, was_clean)
  if not (M.config.save_edits and was_clean) then
    return
  end
  if bufnr == -1 or not vim.api.nvim_buf_is_loaded(bufnr) or not vim.bo[bufnr].modified then
    return
  end
  vim.api.nvim_buf_call(bufnr, function()
    vim.cmd("silent! noautocmd write")
  end)
  local c = M.state.client_id and vim.lsp.get_client_by_id(M.state.client_id)
  if c and vim.lsp.buf_is_attached(bufnr, c.id) then
    client_call(c, "notify", "textDocument/didSave", { textDocument = { uri = vim.uri_from_bufnr(bufnr) } })
  end
end

-- Before the edit lands, each file's text becomes the baseline of its review.
local function snapshot(edit)
  for _, change in ipairs(edit.documentChanges or {}) do
    local uri = change.textDocument and change.textDocument.uri or (change.kind == "create" and change.uri)
    local path = uri and review.rel(vim.uri_to_fname(uri))
    if path then
      review.snapshot(path, change.kind == "create" and vim.fn.filereadable(vim.uri_to_fname(uri)) == 0)
    end
  end
  for uri, _ in pairs(edit.changes or {}) do
    local path = review.rel(vim.uri_to_fname(uri))
    if path then
      review.snapshot(path, false)
    end
  end
end

local function apply_edit(_, params, ctx)
  local client = vim.lsp.get_client_by_id(ctx.client_id)
  local clean = {}
  for uri, _ in pairs(uri_set(params.edit)) do
    local bufnr = vim.fn.bufnr(vim.uri_to_fname(uri))
    clean[uri] = bufnr == -1 or not vim.api.nvim_buf_is_loaded(bufnr) or not vim.bo[bufnr].modified
  end
  pcall(snapshot, params.edit)
  local ok, err = pcall(vim.lsp.util.apply_workspace_edit, params.edit, client and client.offset_encoding or "utf-16")
  if not ok then
    return { applied = false, failureReason = tostring(err) }
  end
  for uri, was_clean in pairs(clean) do
    local bufnr = vim.fn.bufnr(vim.uri_to_fname(uri))
    write(bufnr, was_clean)
    local path = bufnr ~= -1 and review.path_of(bufnr)
    if path then
      review.render(path)
    end
  end
  return { applied = true }
end

-- window/showMessageRequest through vim.ui.select (approvals: Run / Always / Reject).
local function message_request(_, params)
  local actions = params.actions or {}
  if #actions == 0 then
    notify(params.message)
    return vim.NIL
  end
  local choice, done = nil, false
  vim.ui.select(actions, {
    prompt = params.message,
    format_item = function(item)
      return item.title
    end,
  }, function(item)
    choice, done = item, true
  end)
  if not done then -- an asynchronous vim.ui.select (telescope, dressing…)
    vim.wait(600000, function()
      return done
    end, 50)
  end
  return choice or vim.NIL
end

local function show_document(_, params)
  local fname = vim.uri_to_fname(params.uri)
  if params.takeFocus then
    vim.cmd("edit " .. vim.fn.fnameescape(fname))
  else
    vim.fn.bufload(vim.fn.bufadd(fname))
  end
  return { success = true }
end

local function on_event(_, ev)
  if ev then
    show_split()
    M.render(ev)
  end
end

-- -- the client ------------------------------------------------------------------

local function client()
  local id = M.state.client_id
  local c = id and vim.lsp.get_client_by_id(id)
  if not c then
    notify("the server is not running (call require('opencomposer').setup{})", vim.log.levels.ERROR)
  end
  return c
end

local function attach(bufnr)
  local id = M.state.client_id
  if not id or vim.bo[bufnr].buftype ~= "" then
    return
  end
  local name = vim.api.nvim_buf_get_name(bufnr)
  local root = M.config.root
  if name == "" or name:sub(1, #root + 1) ~= root .. "/" then
    return
  end
  if not vim.lsp.buf_is_attached(bufnr, id) then
    vim.lsp.buf_attach_client(bufnr, id)
  end
end

function M.start()
  if M.state.client_id and vim.lsp.get_client_by_id(M.state.client_id) then
    return M.state.client_id
  end
  local cmd = vim.deepcopy(M.config.cmd)
  if M.config.model then
    table.insert(cmd, "--model")
    table.insert(cmd, M.config.model)
  end
  local capabilities = vim.lsp.protocol.make_client_capabilities()
  capabilities.workspace.workspaceEdit = capabilities.workspace.workspaceEdit or {}
  capabilities.workspace.workspaceEdit.documentChanges = true
  capabilities.window = capabilities.window or {}
  capabilities.window.showDocument = { support = true }
  M.state.client_id = start_client({
    name = "opencomposer",
    cmd = cmd,
    root_dir = M.config.root,
    workspace_folders = { { uri = vim.uri_from_fname(M.config.root), name = "root" } },
    capabilities = capabilities,
    init_options = M.config.model and { model = M.config.model } or EMPTY,
    handlers = {
      ["opencomposer/event"] = on_event,
      ["workspace/applyEdit"] = apply_edit,
      ["window/showMessageRequest"] = message_request,
      ["window/showDocument"] = show_document,
    },
    commands = {
      -- the "Ask opencomposer about this selection" code action: let the user edit the query
      ["opencomposer.ask"] = function(command)
        local arg = (command.arguments or {})[1] or {}
        vim.ui.input({ prompt = "Ask opencomposer: ", default = arg.query or "" }, function(query)
          if query and query ~= "" then
            arg.query = query
            arg.prompt = nil
            M.ask_with(arg)
          end
        end)
      end,
    },
  })
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) then
      attach(bufnr)
    end
  end
  return M.state.client_id
end

local function execute(command, argument, on_result, on_error)
  local c = client()
  if not c then
    if on_error then
      on_error({ message = "the server is not running" })
    end
    return
  end
  client_call(c, "request", "workspace/executeCommand", { command = command, arguments = { argument } }, function(err, result)
    if err then
      notify(command .. ": " .. (err.message or vim.inspect(err)), vim.log.levels.ERROR)
      if on_error then
        on_error(err)
      end
      return
    end
    if on_result then
      on_result(result)
    end
  end, 0)
end

-- A server command that may revert files: the edits it sends are not the agent's.
local function quietly(command, argument, on_result)
  review.quiet = review.quiet + 1
  execute(command, argument, function(result)
    review.quiet = review.quiet - 1
    if on_result then
      on_result(result)
    end
  end, function()
    review.quiet = review.quiet - 1
  end)
end

-- The trace records the user's decision on a file (review.lua settles files). The
-- server takes decisions on finished requests only: until then they wait.
function M.decide(session_id, path, decision)
  if M.state.running[session_id] then
    table.insert(M.state.queued, { session_id, path, decision })
    return
  end
  quietly("opencomposer.decide", { session_id = session_id, path = path, decision = decision })
end

function M.flush_decisions(session_id)
  local queued = M.state.queued
  M.state.queued = {}
  for _, d in ipairs(queued) do
    if d[1] == session_id then
      M.decide(d[1], d[2], d[3])
    else
      table.insert(M.state.queued, d)
    end
  end
end

-- -- commands ----------------------------------------------------------------------

function M.ask_with(arg)
  arg.approve = arg.approve or M.config.approve
  if arg.auto_apply_edits == nil then
    arg.auto_apply_edits = M.config.auto_apply_edits
  end
  if arg.session_id == nil and M.state.conversation then
    arg.session_id = M.state.conversation -- a follow-up in the same session
  end
  show_split()
  append({ "", "> " .. (arg.query:gsub("\n", " ")) })
  execute("opencomposer.ask", arg, function(result)
    M.state.results[result.session_id] = result
    M.state.last_result = result
    M.state.conversation = result.session_id
    append({ "", "## " .. result.status .. (result.answer ~= "" and (": " .. result.answer) or "") })
  end, function(err)
    if tostring(err.message):find("cannot continue:", 1, true) then
      M.state.conversation = nil -- the server does not know it: the next request starts anew
      append({ "", "— new session: the next request starts without history" })
    end
  end)
end

-- The next request starts a new session (with a query: that request, at once).
function M.new_session(query)
  if M.state.conversation then
    M.state.conversation = nil
    show_split()
    append({ "", "— new session: the next request starts without history" })
  end
  if query and query ~= "" then
    M.ask(query)
  end
end

function M.ask(query, range)
  local bufnr = vim.api.nvim_get_current_buf()
  local arg = { query = query }
  if vim.api.nvim_buf_get_name(bufnr) ~= "" and vim.bo[bufnr].buftype == "" then
    arg.uri = vim.uri_from_bufnr(bufnr)
    if range then
      local last = vim.api.nvim_buf_get_lines(bufnr, range[2] - 1, range[2], false)[1] or ""
      arg.selection = {
        start = { line = range[1] - 1, character = 0 },
        ["end"] = { line = range[2] - 1, character = #last },
      }
    end
  end
  local open = {}
  for _, b in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(b) and vim.bo[b].buftype == "" and vim.api.nvim_buf_get_name(b) ~= "" then
      table.insert(open, vim.uri_from_bufnr(b))
    end
  end
  if #open > 0 then
    arg.open_files = open
  end
  M.ask_with(arg)
end

function M.cancel(session_id)
  execute("opencomposer.cancel", session_id and { session_id = session_id } or EMPTY, function(result)
    notify("cancelled " .. #(result.cancelled or {}) .. " session(s)")
  end)
end

function M.search(query)
  execute("opencomposer.search", { query = query, k = 20 }, function(hits)
    local items = {}
    for _, h in ipairs(hits or {}) do
      local first = vim.split(h.text or "", "\n", { plain = true })[1] or ""
      table.insert(items, {
        filename = M.config.root .. "/" .. h.path,
        lnum = h.start_line,
        end_lnum = h.end_line,
        text = string.format("%.3f %s", h.score, first),
      })
    end
    vim.fn.setqflist({}, " ", { title = "opencomposer: " .. query, items = items })
    vim.cmd("copen")
  end)
end

function M.undo(session_id)
  session_id = session_id or M.state.session_id
  if not session_id then
    notify("no session to undo", vim.log.levels.WARN)
    return
  end
  quietly("opencomposer.undo", { session_id = session_id }, function(result)
    review.forget_session(session_id)
    M.state.last_undo = result
    notify("reverted " .. table.concat(result.reverted or {}, ", "))
  end)
end

function M.show_review()
  local items = review.items()
  vim.fn.setqflist({}, " ", { title = "opencomposer: changes to review", items = items })
  if #items == 0 then
    notify("no change is waiting for review")
  else
    vim.cmd("copen")
  end
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend("force", vim.deepcopy(defaults), opts or {})
  M.config.root = vim.fn.fnamemodify(M.config.root or vim.fn.getcwd(), ":p"):gsub("/$", "")
  review.root = M.config.root
  review.keys = M.config.keys or {}
  review.decide = M.decide
  review.write = write

  vim.api.nvim_create_user_command("OpenComposerAsk", function(o)
    local range = o.range > 0 and { o.line1, o.line2 } or nil
    if o.args ~= "" then
      M.ask(o.args, range)
    else
      vim.ui.input({ prompt = "Ask opencomposer: " }, function(query)
        if query and query ~= "" then
          M.ask(query, range)
        end
      end)
    end
  end, { nargs = "*", range = true, desc = "Ask the opencomposer agent" })
  vim.api.nvim_create_user_command("OpenComposerCancel", function()
    M.cancel()
  end, { desc = "Stop the running opencomposer sessions" })
  vim.api.nvim_create_user_command("OpenComposerSearch", function(o)
    M.search(o.args)
  end, { nargs = "+", desc = "Semantic code search into the quickfix list" })
  vim.api.nvim_create_user_command("OpenComposerUndo", function(o)
    M.undo(o.args ~= "" and o.args or nil)
  end, { nargs = "?", desc = "Revert the edits of the last (or a given) session" })
  vim.api.nvim_create_user_command("OpenComposerNew", function(o)
    M.new_session(o.args)
  end, { nargs = "*", desc = "Start a new session (the next request, or this one, has no history)" })
  local function current()
    return review.path_of(0)
  end
  local review_commands = {
    OpenComposerAcceptHunk = { review.accept_hunk_at, "Keep the agent's change under the cursor" },
    OpenComposerRejectHunk = { review.reject_hunk_at, "Revert the agent's change under the cursor" },
    OpenComposerAcceptFile = {
      function()
        review.accept_file(current())
      end,
      "Keep every agent change in this file",
    },
    OpenComposerRejectFile = {
      function()
        review.reject_file(current())
      end,
      "Revert every agent change in this file still under review",
    },
    OpenComposerAcceptAll = { review.accept_all, "Keep every agent change under review" },
    OpenComposerRejectAll = { review.reject_all, "Revert every agent change under review" },
    OpenComposerReview = { M.show_review, "List the agent's changes under review (quickfix)" },
  }
  for name, spec in pairs(review_commands) do
    vim.api.nvim_create_user_command(name, function()
      spec[1]()
    end, { desc = spec[2] })
  end

  local group = vim.api.nvim_create_augroup("opencomposer", { clear = true })
  vim.api.nvim_create_autocmd({ "BufReadPost", "BufNewFile", "BufEnter" }, {
    group = group,
    callback = function(ev)
      attach(ev.buf)
    end,
  })
  if M.config.autostart then
    M.start()
  end
  return M
end

return M
