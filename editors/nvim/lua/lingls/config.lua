--- Options of require("lingls").setup(), their defaults and the settings sent to the server.
local M = {}

M.defaults = {
  -- How to start the language server.
  cmd = { "lingls", "--stdio" },
  -- Per-filetype switch; "*" is every filetype not listed. Buffers of disabled filetypes never attach.
  enable = { ["*"] = true, markdown = false, text = false, help = false, gitcommit = false },
  -- Server settings, sent as initializationOptions and workspace/didChangeConfiguration; unset ones keep the
  -- server's defaults. Keys: endpoint (URL of a /v1/completions server; unset: the embedded model), apiKey,
  -- model (directory or model name), maxTokens, maxLines, debounceMs, promptTokens, contextChunks, device,
  -- minLineProbability (automatic suggestions: a line only if the model gave it at least this; 0: every line).
  server = {},
  -- Client-side pause after a keystroke before asking, in ms (the server may wait more: server.debounceMs).
  debounce_ms = 50,
  -- "auto": Neovim's own vim.lsp.inline_completion on 0.12+, the plugin's renderer before that.
  -- true / false force one or the other (partial accept needs the plugin's renderer).
  native = "auto",
  -- Insert-mode keys; set one to false to leave that key alone. Each falls back to the key itself when no
  -- suggestion is shown, so <Tab> still indents.
  keys = {
    accept = "<Tab>",
    accept_word = "<C-Right>",
    accept_line = "<C-Down>",
    dismiss = "<C-]>",
    next = "<M-]>",
    prev = "<M-[>",
  },
}

--- The merged options; `setup` fills it.
M.options = vim.deepcopy(M.defaults)

--- Global on/off switch (:LinglsToggle); the server keeps running while off.
M.on = true

--- Whether setup() has run (for :checkhealth).
M.configured = false

-- vim.validate changed its signature in 0.11; a plain check works on every version.
local function check(opts, name, kind)
  local v = opts[name]
  if v ~= nil and type(v) ~= kind then
    error(("lingls.setup: option %q must be a %s, got %s"):format(name, kind, type(v)), 3)
  end
end

function M.set(opts)
  opts = opts or {}
  for name, kind in pairs({ cmd = "table", enable = "table", server = "table", keys = "table", debounce_ms = "number" }) do
    check(opts, name, kind)
  end
  -- `enable` and `cmd` replace the defaults whole: merging them would keep entries the user meant to drop.
  local merged = vim.tbl_deep_extend("force", vim.deepcopy(M.defaults), opts)
  merged.enable = vim.deepcopy(opts.enable or M.defaults.enable)
  merged.cmd = vim.deepcopy(opts.cmd or M.defaults.cmd)
  M.options = merged
  M.configured = true
  return merged
end

function M.enabled_for(filetype)
  local enable = M.options.enable
  local v = enable[filetype]
  if v == nil then
    v = enable["*"]
  end
  return v ~= false
end

--- Settings in the shape the server reads. The server knows a list of enabled languages ("*": all); the
--- exceptions to "*" are enforced here instead, by never attaching to those filetypes.
function M.server_settings()
  local s = vim.deepcopy(M.options.server)
  local enable = M.options.enable
  if enable["*"] ~= false then
    s.languages = { "*" }
  else
    s.languages = {}
    for ft, on in pairs(enable) do
      if on and ft ~= "*" then
        table.insert(s.languages, ft)
      end
    end
    table.sort(s.languages)
  end
  return s
end

function M.use_native()
  local native = M.options.native
  if native == "auto" then
    return vim.lsp.inline_completion ~= nil
  end
  return native == true
end

return M
