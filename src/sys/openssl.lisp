;;;; OpenSSL's calls that cl+ssl does not bind (libssl and libcrypto, which
;;;; cl+ssl has loaded).  Only cl-plus-ssl-internals.lisp calls them.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +ssl-ctrl-set-tlsext-servername-cb+ 53)
(defconstant +ssl-ctrl-set-tlsext-servername-arg+ 54)
(defconstant +tlsext-nametype-host-name+ 0)

(defconstant +ssl-tlsext-err-ok+ 0
  "A servername or ALPN callback's answer: accepted.")
(defconstant +ssl-tlsext-err-alert-fatal+ 2
  "A servername callback's answer: end the handshake with an alert.")
(defconstant +ssl-tlsext-err-noack+ 3
  "An ALPN callback's answer: no protocol chosen, the handshake goes on.")

(cffi:defcfun ("SSL_CTX_use_PrivateKey_file" %ssl-ctx-use-private-key-file) :int
  ;; The binding of Debian's cl+ssl (20220328) has no path argument.
  (context :pointer)
  (path :string)
  (type :int))

(cffi:defcfun ("SSL_CTX_check_private_key" %ssl-ctx-check-private-key) :int
  (context :pointer))

(cffi:defcfun ("SSL_CTX_callback_ctrl" %ssl-ctx-callback-ctrl) :long
  (context :pointer)
  (command :int)
  (callback :pointer))

(cffi:defcfun ("SSL_CTX_ctrl" %ssl-ctx-ctrl) :long
  (context :pointer)
  (command :int)
  (number :long)
  (argument :pointer))

(cffi:defcfun ("SSL_get_servername" %ssl-get-servername) :pointer
  (ssl :pointer)
  (type :int))

(cffi:defcfun ("SSL_set_SSL_CTX" %ssl-set-ssl-ctx) :pointer
  (ssl :pointer)
  (context :pointer))

(cffi:defcfun ("SSL_CTX_set_alpn_select_cb" %ssl-ctx-set-alpn-select-cb) :void
  (context :pointer)
  (callback :pointer)
  (argument :pointer))

(cffi:defcfun ("SSL_get0_alpn_selected" %ssl-get0-alpn-selected) :void
  (ssl :pointer)
  (data :pointer)
  (length :pointer))

(cffi:defcfun ("ERR_clear_error" forget-tls-errors) :void
  "Empty the calling thread's OpenSSL error queue.  SSL_get_error(3) takes
any error queued there as the cause of the call it is asked about, so a
queue one connection left (cl+ssl's CLOSE does not read what SSL_shutdown
queues; a handler's own TLS call may leave one) would fail the next
handshake step, read or write the worker takes on another.")

(cffi:defcfun ("ERR_peek_error" %err-peek-error) :unsigned-long)

(cffi:defcfun ("ERR_reason_error_string" %err-reason-error-string) :pointer
  (code :unsigned-long))
