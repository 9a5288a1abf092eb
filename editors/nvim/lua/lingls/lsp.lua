--- Starting the lingls client and talking to it, across Neovim 0.10 (client.fn(...)) and 0.11+ (client:fn(...)).
local config = require("lingls.config")

local M = {}

local HAS_011 = vim.fn.has("nvim-0.11") == 1

--- Attach `buf` to the lingls client, starting it on first use. One server process serves every buffer (and
--- every project): it holds the model, which should load once.
function M.attach(buf)
  local settings = config.server_settings()
  return vim.lsp.start({
    name = "lingls",
    cmd = config.options.cmd,
    root_dir = vim.fn.getcwd(),
    init_options = settings,
    settings = settings,
  }, {
    bufnr = buf,
    reuse_client = function(client, cfg)
      return client.name == cfg.name
    end,
  })
end

function M.client(buf)
  return vim.lsp.get_clients({ bufnr = buf, name = "lingls" })[1]
end

--- Send a request; returns its id, or nil when the client is gone.
function M.request(client, method, params, handler, buf)
  local ok, id
  if HAS_011 then
    ok, id = client:request(method, params, handler, buf)
  else
    ok, id = client.request(method, params, handler, buf)
  end
  return ok and id or nil
end

function M.cancel(client, id)
  if HAS_011 then
    client:cancel_request(id)
  else
    client.cancel_request(id)
  end
end

function M.notify(client, method, params)
  if HAS_011 then
    client:notify(method, params)
  else
    client.notify(method, params)
  end
end

--- Run a command the server attached to a suggestion (lingls.accept: the server logs what was accepted).
function M.exec_cmd(client, command, buf)
  if HAS_011 then
    client:exec_cmd(command, { bufnr = buf })
  else
    client.request("workspace/executeCommand", command, function() end, buf)
  end
end

--- Byte offset in `line` of an LSP character offset counted in the client's position encoding.
function M.byte_col(line, character, encoding)
  if encoding == "utf-8" then
    return math.min(character, #line)
  end
  local ok, col
  if HAS_011 then
    ok, col = pcall(vim.str_byteindex, line, encoding, character, false)
  else
    ok, col = pcall(vim.str_byteindex, line, character, encoding == "utf-16")
  end
  return ok and col or #line
end

--- Push the current settings (after a toggle or a new setup) to every running lingls client.
function M.push_settings()
  for _, client in ipairs(vim.lsp.get_clients({ name = "lingls" })) do
    M.notify(client, "workspace/didChangeConfiguration", { settings = config.server_settings() })
  end
end

return M
