--- How a suggestion splits for partial accept. Pure functions: each returns (head, rest) with head .. rest == s.
local M = {}

--- The next word: leading whitespace (newlines included) and then one run of identifier characters or one run
--- of other non-blank characters. "  foo(bar)" -> "  foo", "(bar)"; "(bar)" -> "(", "bar)".
function M.next_word(s)
  local head = s:match("^%s*[%w_]+") or s:match("^%s*[^%w_%s]+") or s
  return head, s:sub(#head + 1)
end

--- The next line: up to (not including) the next newline; when the suggestion starts with a newline, that
--- newline and the line after it, so that repeated presses walk down a multi-line suggestion.
function M.next_line(s)
  local head = s:match("^[^\n]+") or s:match("^\n[^\n]*") or s
  return head, s:sub(#head + 1)
end

return M
