-- Commands only; nothing starts until require("lingls").setup() is called.
if vim.g.loaded_lingls then
  return
end
vim.g.loaded_lingls = true

vim.api.nvim_create_user_command("LinglsToggle", function()
  require("lingls").toggle()
end, { desc = "lingls: turn inline suggestions on or off" })

vim.api.nvim_create_user_command("LinglsStatus", function()
  print("lingls: " .. require("lingls").status())
end, { desc = "lingls: show whether a suggestion is being generated" })
