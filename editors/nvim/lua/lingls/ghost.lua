--- Drawing a suggestion as ghost text: its first line inline at the cursor, the rest as virtual lines below.
local M = {}

M.ns = vim.api.nvim_create_namespace("lingls.ghost")

-- Virtual text shows a tab as a single cell; spaces keep the suggestion's indentation where it will land.
local function untab(buf, s)
  return (s:gsub("\t", string.rep(" ", vim.bo[buf].tabstop)))
end

--- Show `text` at (row, col) (0-based, col in bytes), replacing whatever ghost text `buf` showed. `note` (e.g.
--- "2/3" while cycling) is drawn after the suggestion in another colour.
function M.show(buf, row, col, text, note)
  M.clear(buf)
  local lines = vim.split(text, "\n", { plain = true })
  local chunks = {}
  for i, line in ipairs(lines) do
    chunks[i] = { { untab(buf, line), "LinglsGhost" } }
  end
  if note then
    table.insert(chunks[#chunks], { "  " .. note, "LinglsGhostNote" })
  end
  vim.api.nvim_buf_set_extmark(buf, M.ns, row, col, {
    virt_text = chunks[1],
    virt_text_pos = "inline",
    virt_lines = #chunks > 1 and { unpack(chunks, 2) } or nil,
    hl_mode = "combine",
  })
end

function M.clear(buf)
  if vim.api.nvim_buf_is_valid(buf) then
    vim.api.nvim_buf_clear_namespace(buf, M.ns, 0, -1)
  end
end

return M
