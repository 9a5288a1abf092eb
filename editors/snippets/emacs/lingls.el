;;; lingls.el --- lingls inline completion through lsp-mode  -*- lexical-binding: t; -*-

;; Put this in your init file. Needs lsp-mode 9.0.1 or newer (lsp-inline-completion.el).
;; lingls runs as an add-on next to your usual Python server, so both stay active.

(with-eval-after-load 'lsp-mode
  (lsp-register-client
   (make-lsp-client
    :new-connection (lsp-stdio-connection '("lingls" "--stdio"))
    :activation-fn (lsp-activate-on "python")
    :server-id 'lingls
    :add-on? t
    ;; Sent as initializationOptions; leave a key out to keep the server's default.
    :initialization-options (lambda () (list :maxTokens 64 :debounceMs 50)))))

;; Ask for a suggestion whenever typing pauses (lsp-mode's default pause is 2 s).
(setq lsp-inline-completion-enable t
      lsp-inline-completion-idle-delay 0.3)

;; While a suggestion is shown, lsp-mode's lsp-inline-completion-active-map applies:
;; RET accepts, TAB / M-n and M-p cycle, C-g cancels. `M-x lsp-inline-completion-display' asks explicitly.
(add-hook 'python-mode-hook #'lsp-deferred)
(add-hook 'python-ts-mode-hook #'lsp-deferred)

;;; lingls.el ends here
