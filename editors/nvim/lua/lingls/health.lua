--- :checkhealth lingls: is Neovim new enough, can the server start, is it attached and answering.
local config = require("lingls.config")

local M = {}

local function check_server()
  local cmd = config.options.cmd
  local exe = cmd[1]
  if vim.fn.executable(exe) ~= 1 then
    vim.health.error(("%q is not executable"):format(exe), {
      "pip install lingls (or `pip install -e .` in a clone), then make sure `lingls` is on PATH",
      'or point setup({ cmd = { "/path/to/venv/bin/lingls", "--stdio" } }) at it',
    })
    return
  end
  -- The configured command with --version instead of --stdio (it may be e.g. `python -m lingls.cli --stdio`).
  local version_cmd = vim.tbl_filter(function(arg)
    return arg ~= "--stdio"
  end, cmd)
  table.insert(version_cmd, "--version")
  local res = vim.system(version_cmd, { text = true }):wait(20000)
  if res.code == 0 then
    vim.health.ok(("%s: %s"):format(vim.fn.exepath(exe), vim.trim(res.stdout)))
  else
    vim.health.error(("`%s` failed (exit %s): %s"):format(
      table.concat(version_cmd, " "),
      tostring(res.code),
      vim.trim(res.stderr or "")
    ))
  end
end

local function check_clients()
  local clients = vim.lsp.get_clients({ name = "lingls" })
  if #clients == 0 then
    vim.health.info("no lingls client running yet: it starts when a buffer of an enabled filetype opens")
    return
  end
  for _, client in ipairs(clients) do
    local caps = client.server_capabilities or {}
    if caps.inlineCompletionProvider then
      vim.health.ok(("client %d is up (position encoding %s), serving %d buffer(s)"):format(
        client.id,
        client.offset_encoding,
        vim.tbl_count(client.attached_buffers)
      ))
    else
      vim.health.error(("client %d does not advertise inlineCompletionProvider: is this lingls?"):format(client.id))
    end
  end
end

function M.check()
  vim.health.start("lingls")
  if vim.fn.has("nvim-0.10") ~= 1 then
    vim.health.error("Neovim 0.10 or newer is needed (inline virtual text)")
    return
  end
  if not config.configured then
    vim.health.warn('setup() has not run: add require("lingls").setup({}) to your config')
  end
  vim.health.info(config.use_native() and "renderer: Neovim's vim.lsp.inline_completion"
    or "renderer: lingls ghost text (extmarks)")
  vim.health.info("suggestions are " .. (config.on and "on" or "off (:LinglsToggle)"))
  check_server()
  check_clients()
end

return M
