--- Test-only helper loaded into the headless Neovim under test: lets pytest evaluate Lua and read what the user
--- would see (mode, text, cursor, ghost text drawn by lingls).
local M = {}

--- Run base64-encoded Lua; the value it returns comes back as JSON: {ok = true, value = ...} or {ok = false, error}.
function M.eval(b64)
  local chunk, err = loadstring(vim.base64.decode(b64))
  if not chunk then
    return vim.json.encode({ ok = false, error = err })
  end
  local ok, value = pcall(chunk)
  if not ok then
    return vim.json.encode({ ok = false, error = tostring(value) })
  end
  return vim.json.encode({ ok = true, value = value == nil and vim.NIL or value })
end

--- The ghost text on screen in `buf`, as the user reads it: { row, col, text } or nil. Notes ("2/3") are left out.
local function ghost(buf)
  local ns = vim.api.nvim_get_namespaces()["lingls.ghost"]
  if not ns then
    return nil
  end
  local marks = vim.api.nvim_buf_get_extmarks(buf, ns, 0, -1, { details = true })
  if #marks == 0 then
    return nil
  end
  local _, row, col, details = unpack(marks[1])
  local function join(chunks)
    local parts = {}
    for _, chunk in ipairs(chunks or {}) do
      if chunk[2] == "LinglsGhost" then
        parts[#parts + 1] = chunk[1]
      end
    end
    return table.concat(parts)
  end
  local lines = { join(details.virt_text) }
  for _, virt_line in ipairs(details.virt_lines or {}) do
    lines[#lines + 1] = join(virt_line)
  end
  return { row = row, col = col, text = table.concat(lines, "\n"), marks = #marks }
end

function M.state()
  local buf = vim.api.nvim_get_current_buf()
  local cursor = vim.api.nvim_win_get_cursor(0)
  return {
    mode = vim.api.nvim_get_mode().mode,
    lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false),
    row = cursor[1] - 1,
    col = cursor[2],
    ghost = ghost(buf) or vim.NIL,
    status = require("lingls").status(),
    -- The suggestion as the plugin holds it (the ghost text shows it with tabs expanded).
    current = require("lingls.completion").current() or vim.NIL,
    tabstop = vim.bo[buf].tabstop,
    clients = #vim.lsp.get_clients({ bufnr = buf, name = "lingls" }),
  }
end

return M
