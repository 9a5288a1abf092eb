--- The plugin's own inline completion, for Neovim 0.10 and 0.11 (which have none): ask the server after a pause in
--- typing, draw the answer as ghost text, let the user type through it or accept all / a word / a line of it.
---
--- Rules that keep it honest: only in insert mode; one request per buffer at a time (a new one cancels the previous
--- with $/cancelRequest); an answer is shown only if the buffer, text and cursor are still those it was asked for.
local config = require("lingls.config")
local lsp = require("lingls.lsp")
local ghost = require("lingls.ghost")
local split = require("lingls.text")

local M = {}
local api = vim.api
local uv = vim.uv or vim.loop

local INVOKED, AUTOMATIC = 1, 2

--- Per buffer:
---  seq      number of the newest request; an answer carrying an older number is stale
---  pending  { client, id } of the request in flight, cancelled when superseded
---  timer    the debounce timer
---  items    suggestions of the last answer: { text, replace, command, client } (replace: bytes after the cursor
---           the suggestion overwrites, from the item's range)
---  index    which item is shown; origin: { row, col } the items were asked for
---  shown    what is on screen: { row, col, tick, text, replace, item, at_origin }
---  error    the last error the server answered, for status()
local states = {}

local function state(buf)
  local st = states[buf]
  if not st then
    st = { seq = 0, timer = uv.new_timer() }
    states[buf] = st
  end
  return st
end

local function in_insert_mode()
  return api.nvim_get_mode().mode:sub(1, 1) == "i"
end

--- 0-based row, byte column.
local function cursor()
  local c = api.nvim_win_get_cursor(0)
  return c[1] - 1, c[2]
end

local function cancel_pending(st)
  st.timer:stop()
  if st.pending then
    lsp.cancel(st.pending.client, st.pending.id)
    st.pending = nil
  end
end

--- Hide the suggestion and drop everything in flight for `buf`.
function M.clear(buf)
  local st = states[buf]
  if not st then
    return
  end
  cancel_pending(st)
  st.seq = st.seq + 1
  st.items, st.index, st.origin, st.shown = nil, nil, nil, nil
  ghost.clear(buf)
end

local function show(buf, st, text, item, row, col, at_origin)
  st.shown = {
    row = row,
    col = col,
    tick = api.nvim_buf_get_changedtick(buf),
    text = text,
    replace = item.replace,
    item = item,
    at_origin = at_origin,
  }
  local note = at_origin and #st.items > 1 and ("%d/%d"):format(st.index, #st.items) or nil
  ghost.show(buf, row, col, text, note)
end

local function show_item(buf, st)
  show(buf, st, st.items[st.index].text, st.items[st.index], st.origin.row, st.origin.col, true)
end

--- Turn an answer into items relative to the cursor at (row, col). An item with a range must lie on the cursor's
--- line, start at or before the cursor and repeat what is already typed there; what is left is the ghost text.
--- Snippet items are skipped: ghost text is plain text.
local function parse(buf, client, row, col, result)
  local line = api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ""
  local items, seen = {}, {}
  for _, raw in ipairs(result and (result.items or result) or {}) do
    local text, replace = raw.insertText, 0
    if type(text) == "string" and raw.range then
      local r, enc = raw.range, client.offset_encoding
      local s = lsp.byte_col(line, r.start.character, enc)
      local e = lsp.byte_col(line, r["end"].character, enc)
      local typed = line:sub(s + 1, col)
      if r.start.line ~= row or r["end"].line ~= row or s > col or e < col or text:sub(1, #typed) ~= typed then
        text = nil
      else
        text, replace = text:sub(#typed + 1), e - col
      end
    end
    if type(text) == "string" and text ~= "" and not seen[text] then
      seen[text] = true
      items[#items + 1] = { text = text, replace = replace, command = raw.command, client = client }
    end
  end
  return items
end

local function report(st, err)
  if err.code == -32800 then -- RequestCancelled: we asked for it
    return
  end
  local msg = err.message or vim.inspect(err)
  if st.error ~= msg then
    vim.notify("lingls: " .. msg, vim.log.levels.WARN)
  end
  st.error = msg
end

--- Ask for suggestions at the cursor. `avoid`: text already shown, so that an Invoked request (cycling) moves
--- to a different suggestion.
local function request(buf, kind, avoid)
  local st = state(buf)
  cancel_pending(st)
  local client = lsp.client(buf)
  if not client or not config.on then
    return
  end
  local row, col = cursor()
  local tick = api.nvim_buf_get_changedtick(buf)
  st.seq = st.seq + 1
  local seq = st.seq
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = kind }
  local id
  id = lsp.request(client, "textDocument/inlineCompletion", params, function(err, result)
    if st.pending and st.pending.id == id then
      st.pending = nil
    end
    if err then
      report(st, err)
      return
    end
    st.error = nil
    local r, c = cursor()
    local fresh = seq == st.seq
      and api.nvim_get_current_buf() == buf
      and in_insert_mode()
      and api.nvim_buf_get_changedtick(buf) == tick
      and r == row
      and c == col
    if not fresh then
      return
    end
    local items = parse(buf, client, row, col, result)
    if #items == 0 then
      return
    end
    st.items, st.index, st.origin = items, 1, { row = row, col = col }
    if avoid and items[1].text == avoid and #items > 1 then
      st.index = 2
    end
    show_item(buf, st)
  end, buf)
  if id then
    st.pending = { client = client, id = id }
  end
end

--- Ask again once typing pauses.
function M.schedule(buf)
  local st = state(buf)
  st.timer:stop()
  st.timer:start(
    config.options.debounce_ms,
    0,
    vim.schedule_wrap(function()
      if api.nvim_buf_is_valid(buf) and api.nvim_get_current_buf() == buf and in_insert_mode() then
        request(buf, AUTOMATIC)
      end
    end)
  )
end

--- After the text or the cursor changed: keep the suggestion if the user typed its next characters (type-through),
--- otherwise hide it and ask again.
function M.refresh(buf)
  local st = state(buf)
  local row, col = cursor()
  local shown = st.shown
  if shown and shown.row == row and shown.col == col and shown.tick == api.nvim_buf_get_changedtick(buf) then
    return -- our own edit (accept) or a second event for the same change
  end
  if shown and row == shown.row and col > shown.col then
    local typed = api.nvim_buf_get_lines(buf, row, row + 1, false)[1]:sub(shown.col + 1, col)
    if #typed < #shown.text and shown.text:sub(1, #typed) == typed then
      show(buf, st, shown.text:sub(#typed + 1), shown.item, row, col, false)
      return
    end
  end
  M.clear(buf)
  if config.on then
    M.schedule(buf)
  end
end

--- The suggestion shown in the current buffer, or nil.
function M.current()
  local st = states[api.nvim_get_current_buf()]
  return st and st.shown and st.shown.text or nil
end

--- Insert all of the suggestion, or its next word or line ("all" | "word" | "line"). The rest stays shown.
--- Returns false when nothing was shown.
function M.accept(how)
  local buf = api.nvim_get_current_buf()
  local st = states[buf]
  local shown = st and st.shown
  if not shown then
    return false
  end
  local head, rest = shown.text, ""
  if how == "word" then
    head, rest = split.next_word(shown.text)
  elseif how == "line" then
    head, rest = split.next_line(shown.text)
  end
  local lines = vim.split(head, "\n", { plain = true })
  -- The characters the item replaces after the cursor go only when the whole suggestion goes in.
  local replace = rest == "" and shown.replace or 0
  api.nvim_buf_set_text(buf, shown.row, shown.col, shown.row, shown.col + replace, lines)
  local row = shown.row + #lines - 1
  local col = (#lines == 1 and shown.col or 0) + #lines[#lines]
  api.nvim_win_set_cursor(0, { row + 1, col })
  if rest == "" then
    -- The edit fires TextChangedI, whose refresh() asks for what comes next.
    M.clear(buf)
    local item = shown.item
    if item.command then
      lsp.exec_cmd(item.client, item.command, buf)
    end
  else
    cancel_pending(st)
    show(buf, st, rest, shown.item, row, col, false)
  end
  return true
end

--- Hide the suggestion until the next edit.
function M.dismiss()
  M.clear(api.nvim_get_current_buf())
end

--- Show the next (delta 1) or previous (-1) suggestion; the first press asks the server for several (Invoked).
function M.cycle(delta)
  local buf = api.nvim_get_current_buf()
  local st = state(buf)
  local shown = st.shown
  if shown and shown.at_origin and #st.items > 1 then
    st.index = (st.index - 1 + delta) % #st.items + 1
    show_item(buf, st)
  else
    request(buf, INVOKED, shown and shown.text)
  end
end

--- "generating", "ready", "off" or "error: ..." for a statusline.
function M.status(buf)
  local st = states[buf or api.nvim_get_current_buf()]
  if not config.on then
    return "off"
  elseif st and st.pending then
    return "generating"
  elseif st and st.error then
    return "error: " .. st.error
  end
  return "ready"
end

local function map(buf, lhs, action, fallback)
  if not lhs then
    return
  end
  vim.keymap.set("i", lhs, function()
    if fallback and not M.current() then
      return lhs
    end
    return "<Cmd>lua require('lingls.completion')." .. action .. "<CR>"
  end, { buffer = buf, expr = true, desc = "lingls: " .. action })
end

--- Start watching `buf`: events and keys. Safe to call twice.
function M.attach(buf)
  local st = state(buf)
  if st.attached then
    return
  end
  st.attached = true
  local group = api.nvim_create_augroup("lingls.buf." .. buf, { clear = true })
  local function on(events, fn)
    api.nvim_create_autocmd(events, { group = group, buffer = buf, callback = fn })
  end
  on("InsertEnter", function()
    if config.on then
      M.schedule(buf)
    end
  end)
  -- The server may still be starting when the user begins typing: ask as soon as it is attached.
  on("LspAttach", function(args)
    local client = vim.lsp.get_client_by_id(args.data.client_id)
    if client and client.name == "lingls" and config.on and in_insert_mode() then
      M.schedule(buf)
    end
  end)
  on({ "TextChangedI", "CursorMovedI" }, function()
    M.refresh(buf)
  end)
  on({ "InsertLeave", "BufLeave" }, function()
    M.clear(buf)
  end)
  on("BufWipeout", function()
    M.clear(buf)
    st.timer:close()
    states[buf] = nil
    api.nvim_del_augroup_by_id(group)
  end)
  local keys = config.options.keys
  map(buf, keys.accept, 'accept("all")', true)
  map(buf, keys.accept_word, 'accept("word")', true)
  map(buf, keys.accept_line, 'accept("line")', true)
  map(buf, keys.dismiss, "dismiss()", true)
  map(buf, keys.next, "cycle(1)", false)
  map(buf, keys.prev, "cycle(-1)", false)
end

--- Hide suggestions in every buffer (used when suggestions are turned off).
function M.clear_all()
  for buf in pairs(states) do
    M.clear(buf)
  end
end

return M
