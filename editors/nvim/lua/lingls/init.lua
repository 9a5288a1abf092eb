--- lingls for Neovim: require("lingls").setup({...}) starts `lingls --stdio` for the filetypes it is enabled for
--- and shows its inline completions as ghost text (see editors/nvim/README.md for the options and keys).
local config = require("lingls.config")
local lsp = require("lingls.lsp")

local M = {}

local function renderer()
  return config.use_native() and require("lingls.native") or require("lingls.completion")
end

--- Start lingls for `buf` if it is a file buffer of an enabled filetype.
function M.attach(buf)
  if vim.bo[buf].buftype ~= "" or not config.enabled_for(vim.bo[buf].filetype) then
    return
  end
  if lsp.attach(buf) then
    renderer().attach(buf)
  end
end

--- The highlight groups, unless the user set them. `LinglsGhost` is `Comment` when the colorscheme gives
--- `Comment` a terminal colour; otherwise (Neovim's own scheme gives it a GUI colour only, so without
--- 'termguicolors' the suggestion would look like real code) `Comment`'s GUI colour with a grey, italic
--- fallback for terminals.
local function define_highlights()
  local comment = vim.api.nvim_get_hl(0, { name = "Comment", link = false })
  if comment.ctermfg then
    vim.api.nvim_set_hl(0, "LinglsGhost", { link = "Comment", default = true })
  else
    vim.api.nvim_set_hl(0, "LinglsGhost", {
      fg = comment.fg or 0x808080,
      ctermfg = 8,
      cterm = { italic = true },
      default = true,
    })
  end
  vim.api.nvim_set_hl(0, "LinglsGhostNote", { link = "NonText", default = true })
end

function M.setup(opts)
  config.set(opts)
  define_highlights()
  local group = vim.api.nvim_create_augroup("lingls", { clear = true })
  vim.api.nvim_create_autocmd("ColorScheme", { group = group, callback = define_highlights })
  vim.api.nvim_create_autocmd("FileType", {
    group = group,
    callback = function(args)
      M.attach(args.buf)
    end,
  })
  -- Buffers opened before setup() ran (e.g. setup from a lazy loader) get their FileType only once.
  for _, buf in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(buf) and vim.bo[buf].filetype ~= "" then
      M.attach(buf)
    end
  end
  lsp.push_settings()
end

--- Turn suggestions on or off everywhere (`:LinglsToggle`). The server stays up with the model loaded.
function M.toggle()
  config.on = not config.on
  local r = renderer()
  if config.use_native() then
    r.set_enabled(config.on)
  elseif not config.on then
    r.clear_all()
  end
  vim.notify("lingls: suggestions " .. (config.on and "on" or "off"))
end

--- For a statusline: "off", "ready", "generating" or "error: ..." (the plugin's renderer only).
function M.status()
  if not config.use_native() then
    return require("lingls.completion").status()
  end
  return config.on and "ready" or "off"
end

return M
