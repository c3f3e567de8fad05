-- A decision taken while the agent still runs waits for the request's end (see
-- test_nvim_review.py). Env as nvim_review.lua.
vim.opt.runtimepath:prepend(os.getenv("OC_PLUGIN"))
local root = os.getenv("OC_ROOT")
local out = { errors = {} }
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
  assert(vim.wait(30000, function()
    local c = vim.lsp.get_client_by_id(oc.state.client_id)
    return c ~= nil and c.initialized and vim.lsp.buf_is_attached(0, oc.state.client_id)
  end, 20), "no server")
  vim.cmd("OpenComposerAsk fix add")
  assert(vim.wait(30000, function()
    return oc.review.files["calc.py"] ~= nil and oc.review.files["test_calc.py"] ~= nil
  end, 10), "no review")
  out.running_at_accept = oc.state.running[oc.state.session_id] == true
  vim.cmd("OpenComposerAcceptAll")
  out.queued = #oc.state.queued
  assert(vim.wait(60000, function() return oc.state.last_result ~= nil end, 20), "no answer")
  assert(vim.wait(10000, function() return #oc.state.queued == 0 and oc.review.quiet == 0 end, 20))
  out.result = oc.state.last_result
end)
if not ok then out.error = tostring(err) end
local f = io.open(os.getenv("OC_OUT"), "w")
f:write(vim.fn.json_encode(out))
f:close()
vim.cmd("qall!")
