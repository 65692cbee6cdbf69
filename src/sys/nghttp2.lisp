;;;; libnghttp2 (Debian's libnghttp2-14, 1.52) through CFFI: the functions,
;;;; structures and constants of its server side that the engine uses.  The
;;;; library does no I/O: octets read are given to it, frames to write are
;;;; taken from it.  Only engine/http2/nghttp2-session.lisp calls these.

(in-package #:hunchentoot-recycling-taskmaster)

(cffi:define-foreign-library nghttp2
  (t (:or "libnghttp2.so.14" "libnghttp2.so")))

(cffi:use-foreign-library nghttp2)

;;; Frames (RFC 9113 6) and their flags.
(defconstant +nghttp2-data+ 0)
(defconstant +nghttp2-headers+ 1)
(defconstant +nghttp2-priority+ 2)
(defconstant +nghttp2-rst-stream+ 3)
(defconstant +nghttp2-settings+ 4)
(defconstant +nghttp2-ping+ 6)
(defconstant +nghttp2-goaway+ 7)
(defconstant +nghttp2-window-update+ 8)
(defconstant +nghttp2-continuation+ 9)
(defconstant +nghttp2-flag-end-stream+ #x01)
(defconstant +nghttp2-data-flag-eof+ #x01)

;;; Settings (RFC 9113 6.5.2).
(defconstant +nghttp2-settings-max-concurrent-streams+ 3)
(defconstant +nghttp2-settings-max-header-list-size+ 6)

;;; Error codes of RST_STREAM and GOAWAY (RFC 9113 7).
(defconstant +nghttp2-no-error+ 0)
(defconstant +nghttp2-protocol-error+ 1)
(defconstant +nghttp2-internal-error+ 2)
(defconstant +nghttp2-refused-stream+ 7)
(defconstant +nghttp2-enhance-your-calm+ #xb)

;;; The library's own error codes.
(defconstant +nghttp2-err-deferred+ -508)
(defconstant +nghttp2-err-temporal-callback-failure+ -521)
(defconstant +nghttp2-err-callback-failure+ -902)

(cffi:defcstruct nghttp2-frame-hd
  (length :size)
  (stream-id :int32)
  (type :uint8)
  (flags :uint8)
  (reserved :uint8))

(cffi:defcstruct nghttp2-goaway
  (hd (:struct nghttp2-frame-hd))
  (last-stream-id :int32)
  (error-code :uint32))

(cffi:defcstruct nghttp2-nv
  (name :pointer)
  (value :pointer)
  (namelen :size)
  (valuelen :size)
  (flags :uint8))

(cffi:defcstruct nghttp2-settings-entry
  (settings-id :int32)
  (value :uint32))

(cffi:defcstruct nghttp2-data-provider
  (source :pointer)
  (read-callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_new" %nghttp2-callbacks-new) :int
  (callbacks-pointer :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_del" %nghttp2-callbacks-del) :void
  (callbacks :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_begin_headers_callback" %nghttp2-set-on-begin-headers) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_header_callback" %nghttp2-set-on-header) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_frame_recv_callback" %nghttp2-set-on-frame-recv) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_data_chunk_recv_callback" %nghttp2-set-on-data-chunk-recv) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_stream_close_callback" %nghttp2-set-on-stream-close) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_begin_frame_callback" %nghttp2-set-on-begin-frame) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_callbacks_set_on_frame_send_callback" %nghttp2-set-on-frame-send) :void
  (callbacks :pointer) (callback :pointer))

(cffi:defcfun ("nghttp2_session_server_new" %nghttp2-session-server-new) :int
  (session-pointer :pointer) (callbacks :pointer) (user-data :pointer))

(cffi:defcfun ("nghttp2_session_del" %nghttp2-session-del) :void
  (session :pointer))

(cffi:defcfun ("nghttp2_session_mem_recv" %nghttp2-session-mem-recv) :long
  (session :pointer) (in :pointer) (length :size))

(cffi:defcfun ("nghttp2_session_mem_send" %nghttp2-session-mem-send) :long
  (session :pointer) (data-pointer :pointer))

(cffi:defcfun ("nghttp2_session_want_read" %nghttp2-session-want-read) :int
  (session :pointer))

(cffi:defcfun ("nghttp2_session_want_write" %nghttp2-session-want-write) :int
  (session :pointer))

(cffi:defcfun ("nghttp2_submit_settings" %nghttp2-submit-settings) :int
  (session :pointer) (flags :uint8) (entries :pointer) (count :size))

(cffi:defcfun ("nghttp2_submit_response" %nghttp2-submit-response) :int
  (session :pointer) (stream-id :int32) (nva :pointer) (nvlen :size) (data-provider :pointer))

(cffi:defcfun ("nghttp2_session_resume_data" %nghttp2-session-resume-data) :int
  (session :pointer) (stream-id :int32))

(cffi:defcfun ("nghttp2_submit_rst_stream" %nghttp2-submit-rst-stream) :int
  (session :pointer) (flags :uint8) (stream-id :int32) (error-code :uint32))

(cffi:defcfun ("nghttp2_submit_goaway" %nghttp2-submit-goaway) :int
  (session :pointer) (flags :uint8) (last-stream-id :int32) (error-code :uint32)
  (opaque-data :pointer) (opaque-data-length :size))

(cffi:defcfun ("nghttp2_session_terminate_session" %nghttp2-session-terminate) :int
  (session :pointer) (error-code :uint32))

(cffi:defcfun ("nghttp2_session_get_last_proc_stream_id" %nghttp2-last-processed-stream-id) :int32
  (session :pointer))

(cffi:defcfun ("nghttp2_strerror" %nghttp2-strerror) :string
  (error-code :int))
