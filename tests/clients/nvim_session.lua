-- Drives the opencomposer plugin in headless Neovim (see test_nvim_plugin.py).
-- Env: OC_PLUGIN (clients/nvim), OC_ROOT, OC_PYTHON, OC_MODEL, OC_OUT (result JSON).
vim.opt.runtimepath:prepend(os.getenv("OC_PLUGIN"))
local out = { steps = {} }
local function finish()
  local f = io.open(os.getenv("OC_OUT"), "w")
  f:write(vim.fn.json_encode(out))
  f:close()
  vim.cmd("qall!")
end
local ok, err = pcall(function()
  local selects = {}
  vim.ui.select = function(items, opts, on_choice)
    table.insert(selects, { prompt = opts.prompt, titles = vim.tbl_map(function(i) return i.title end, items) })
    on_choice(items[1], 1) -- "Run"
  end
  local oc = require("opencomposer")
  oc.setup({
    cmd = { os.getenv("OC_PYTHON"), "-m", "opencomposer.server.lsp", "--stdio" },
    model = os.getenv("OC_MODEL"),
    root = os.getenv("OC_ROOT"),
  })
  vim.cmd("edit " .. os.getenv("OC_ROOT") .. "/calc.py")
  local attached = vim.wait(30000, function()
    local c = vim.lsp.get_client_by_id(oc.state.client_id)
    return c ~= nil and c.initialized and vim.lsp.buf_is_attached(0, oc.state.client_id)
  end, 50)
  table.insert(out.steps, "attached=" .. tostring(attached))
  vim.cmd("OpenComposerAsk fix the failing test")
  local done = vim.wait(60000, function() return oc.state.last_result ~= nil end, 50)
  table.insert(out.steps, "done=" .. tostring(done))
  out.result = oc.state.last_result
  out.buffer = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  out.modified = vim.api.nvim_buf_get_option(0, "modified")
  out.selects = selects
  out.split = vim.api.nvim_buf_get_lines(oc.state.buf, 0, -1, false)
  out.disk = vim.fn.readfile(os.getenv("OC_ROOT") .. "/calc.py")
  -- undo through the server: the buffer goes back
  oc.undo()
  vim.wait(20000, function()
    return vim.api.nvim_buf_get_lines(0, 1, 2, false)[1] == "    return a - b"
  end, 50)
  out.after_undo = vim.api.nvim_buf_get_lines(0, 0, -1, false)
end)
if not ok then out.error = tostring(err) end
finish()
