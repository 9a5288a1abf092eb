--- Neovim 0.12+: its own vim.lsp.inline_completion draws and accepts suggestions; lingls only adds its keys.
--- Partial accept (word / line) and dismiss belong to the plugin's renderer: set `native = false` for them.
local config = require("lingls.config")

local M = {}

function M.attach(buf)
  local ic = vim.lsp.inline_completion
  ic.enable(config.on, { bufnr = buf })
  local keys = config.options.keys
  if keys.accept then
    vim.keymap.set("i", keys.accept, function()
      if not ic.get({ bufnr = buf }) then
        return keys.accept
      end
    end, { buffer = buf, expr = true, desc = "lingls: accept" })
  end
  for name, count in pairs({ next = 1, prev = -1 }) do
    if keys[name] then
      vim.keymap.set("i", keys[name], function()
        ic.select({ bufnr = buf, count = count })
      end, { buffer = buf, desc = "lingls: " .. name })
    end
  end
end

--- Follow a global toggle in every buffer.
function M.set_enabled(on)
  vim.lsp.inline_completion.enable(on)
end

return M
