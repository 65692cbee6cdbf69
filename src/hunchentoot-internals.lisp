;;;; Every use of a symbol that Hunchentoot 1.2.38 does not export lives in
;;;; this file, so that the next Hunchentoot breaks in one place.

(in-package #:hunchentoot-recycling-taskmaster)

(defun default-max-thread-count ()
  "Hunchentoot's default for MAX-THREAD-COUNT (100), so that a user who set it
sees the same default here."
  hunchentoot::*default-max-thread-count*)

(defun default-max-accept-count ()
  "Hunchentoot's default for MAX-ACCEPT-COUNT (MAX-THREAD-COUNT + 20), which a
RECYCLING-TASKMASTER takes but does not need."
  hunchentoot::*default-max-accept-count*)

(defun acceptor-listen-socket (acceptor)
  "The usocket ACCEPTOR listens on while started."
  (hunchentoot::acceptor-listen-socket acceptor))

(defun (setf acceptor-listen-socket) (socket acceptor)
  (setf (hunchentoot::acceptor-listen-socket acceptor) socket))

(defun acceptor-shutting-down-p (acceptor)
  "True once HUNCHENTOOT:STOP has begun on ACCEPTOR."
  (hunchentoot::acceptor-shutdown-p acceptor))

(defun (setf acceptor-shutting-down-p) (value acceptor)
  (setf (hunchentoot::acceptor-shutdown-p acceptor) value))

(defun acceptor-server-name (acceptor)
  "What ACCEPTOR's replies say in their Server header."
  (hunchentoot::acceptor-server-name acceptor))

(defun acceptor-taskmaster (acceptor)
  "ACCEPTOR's taskmaster, which Hunchentoot does not export a reader for."
  (hunchentoot::acceptor-taskmaster acceptor))

(defmacro with-connection-bindings (() &body body)
  "Bind the per-connection specials that Hunchentoot's reply code reads and
writes: the connection stream and whether to close it at the end."
  `(let ((hunchentoot::*hunchentoot-stream* nil)
         (hunchentoot::*close-hunchentoot-stream* t))
     ,@body))

(defmacro with-request-bindings (() &body body)
  "Bind the per-request specials: *FINISH-PROCESSING-SOCKET* starts true and
START-OUTPUT clears it when the reply keeps the connection alive."
  `(let ((hunchentoot::*finish-processing-socket* t))
     ,@body))

(defun current-connection-stream ()
  "The stream Hunchentoot's reply code writes the current reply to."
  hunchentoot::*hunchentoot-stream*)

(defun (setf current-connection-stream) (stream)
  (setf hunchentoot::*hunchentoot-stream* stream))

(defun close-connection-stream-p ()
  "False when a handler called HUNCHENTOOT:DETACH-SOCKET."
  hunchentoot::*close-hunchentoot-stream*)

(defun finish-processing-connection-p ()
  "True when the reply just sent ends the connection."
  hunchentoot::*finish-processing-socket*)

(defun (setf finish-processing-connection-p) (value)
  (setf hunchentoot::*finish-processing-socket* value))

(defun requests-in-progress-location (acceptor)
  "The location (SB-MOP:STANDARD-INSTANCE-ACCESS) of ACCEPTOR's count of
requests in progress, the slot Hunchentoot's ACCEPTOR-REQUESTS-IN-PROGRESS
reads, as ACCEPTOR's class is now."
  (instance-slot-location (find 'hunchentoot::requests-in-progress
                                (instance-slots (finalized-class (class-of acceptor)))
                                :key #'instance-slot-name)))

(defun add-to-requests-in-progress (acceptor location amount)
  "Add AMOUNT to ACCEPTOR's count of requests in progress, at LOCATION, by
compare-and-swap."
  (loop for old = (instance-slot-value acceptor location)
        until (compare-and-swap (instance-slot-value acceptor location) old (+ old amount))))

(defun call-with-request-counted (acceptor location function)
  "Call FUNCTION with ACCEPTOR's count of requests in progress (at LOCATION)
raised, as Hunchentoot's own connection loop does, but without the
acceptor's shutdown lock, which every worker would take twice a request
(bench/profiles/2026-11-24-threaded-floor.txt).  Hunchentoot's soft STOP
waits on that lock's condition variable for the count to fall to zero; a
parallel acceptor's STOP waits for its workers instead (pool/lifecycle.lisp),
so the lock is taken only once STOP has begun."
  (add-to-requests-in-progress acceptor location 1)
  (unwind-protect (funcall function)
    (add-to-requests-in-progress acceptor location -1)
    ;; As Hunchentoot does, for a STOP of its own that a mixin may run.
    (when (acceptor-shutting-down-p acceptor)
      (bt:with-lock-held ((hunchentoot::acceptor-shutdown-lock acceptor))
        (bt:condition-notify (hunchentoot::acceptor-shutdown-queue acceptor))))))

(defun content-type-charset (content-type)
  "The charset parameter of the Content-Type header value CONTENT-TYPE when
its type is text, as Hunchentoot reads it, else NIL."
  (nth-value 2 (hunchentoot::parse-content-type content-type)))

(defun reply-headers (reply)
  "REPLY's outgoing headers alist, read from its slot: the reader
HUNCHENTOOT:HEADERS-OUT of a PARALLEL-REPLY checks them as it returns them."
  (slot-value reply 'hunchentoot:headers-out))

(defun easy-handler-alist ()
  "Hunchentoot's list of easy handlers, as DEFINE-EASY-HANDLER keeps it:
each a list of the path (or a predicate of the request), the acceptor names
(or T), the handler's name and, from Hunchentoot 1.3, the host (or NIL);
the latest first."
  hunchentoot::*easy-handler-alist*)

(defun (setf reply-headers) (headers reply)
  "Replace REPLY's outgoing headers alist, in its slot."
  (setf (slot-value reply 'hunchentoot:headers-out) headers))

(defun (setf reply-content-length) (length reply)
  "Set what HUNCHENTOOT:CONTENT-LENGTH of REPLY returns, as Hunchentoot's
(SETF HEADER-OUT) of Content-Length does beside the header."
  (setf (slot-value reply 'hunchentoot:content-length) length))

(defun (setf reply-content-type) (content-type reply)
  "Set what HUNCHENTOOT:CONTENT-TYPE of REPLY returns, as Hunchentoot's
(SETF HEADER-OUT) of Content-Type does beside the header."
  (setf (slot-value reply 'hunchentoot:content-type) content-type))

(defun (setf request-headers-in) (headers request)
  "Replace what HUNCHENTOOT:HEADERS-IN of REQUEST returns."
  (setf (slot-value request 'hunchentoot::headers-in) headers))

;;; What PROCESS-REQUEST and START-OUTPUT are made of, for the engine's own
;;; PROCESS-REQUEST (engine/serving/reply.lisp).

(defmacro with-request-specials ((request) &body body)
  "Bind the specials Hunchentoot's PROCESS-REQUEST binds around one request:
its temporary files, whether its headers are sent, and *REQUEST*."
  `(let ((hunchentoot::*tmp-files* '())
         (hunchentoot::*headers-sent* nil)
         (hunchentoot:*request* ,request))
     ,@body))

(defmacro catching-request-end (&body body)
  "Run BODY where Hunchentoot's reply code may end the request early: START-OUTPUT
throws once a HEAD request's headers are sent."
  `(catch 'hunchentoot::request-processed ,@body))

(defmacro catching-handler-end (&body body)
  "Run BODY where HUNCHENTOOT:ABORT-REQUEST-HANDLER and a handler's error end
the handler: the handler's contents, or NIL, the error and its backtrace."
  `(catch 'hunchentoot::handler-done ,@body))

(defmacro with-hunchentoot-debugger (&body body)
  "Run BODY as Hunchentoot runs a reply: BAD-REQUEST becomes 400, and an
error enters the debugger when HUNCHENTOOT:*CATCH-ERRORS-P* is false."
  `(hunchentoot::with-debugger ,@body))

(defun headers-sent-p ()
  "True once the current request's status line and headers are written."
  hunchentoot::*headers-sent*)

(defun (setf headers-sent-p) (value)
  (setf hunchentoot::*headers-sent* value))

(defun delete-request-temporary-files ()
  "Delete the uploaded files of the current request that its handler left."
  (dolist (path hunchentoot::*tmp-files*)
    (when (and (pathnamep path) (probe-file path))
      ;; The handler may have moved or deleted it.
      (ignore-errors (delete-file path)))))

(defun hunchentoot-start-output (return-code content)
  "Hunchentoot's own START-OUTPUT: headers and CONTENT written through its
flexi-stream."
  (hunchentoot::start-output return-code content))

(defun header-out-set-p (name)
  "True when the current reply has a header NAME, NIL-valued or not."
  (hunchentoot::header-out-set-p name))

(defun rewrite-urls-for-session (html)
  "HTML with the current session's cookie value added to its links, as
START-OUTPUT rewrites an HTML body: only when HUNCHENTOOT:*REWRITE-FOR-SESSION-URLS*
is true and the request has a session but did not send its cookie; else
HTML itself."
  (hunchentoot::maybe-rewrite-urls-for-session html))

(defun cookie-header-value (cookie)
  "The value of the Set-Cookie header Hunchentoot writes for COOKIE."
  (hunchentoot::stringify-cookie cookie))

;;; What Hunchentoot's request initializer computes, for the engine's request
;;; constructor (engine/http/request-object.lisp), which computes the same fields
;;; and leaves GET parameters and cookies to be parsed on first use.

(defun request-initializer-method ()
  "Hunchentoot's INITIALIZE-INSTANCE :AFTER method on HUNCHENTOOT:REQUEST,
which parses the request's URI, GET parameters and cookies and verifies its
session."
  (find-method #'initialize-instance '(:after) (list (find-class 'hunchentoot:request))))

(defun reply-initializer-method ()
  "Hunchentoot's INITIALIZE-INSTANCE :AFTER method on HUNCHENTOOT:REPLY,
which sets the reply's Content-Type to HUNCHENTOOT:*DEFAULT-CONTENT-TYPE*
through (SETF HUNCHENTOOT:HEADER-OUT)."
  (find-method #'initialize-instance '(:after) (list (find-class 'hunchentoot:reply))))

(defun default-session-verify-method ()
  "Hunchentoot's HUNCHENTOOT:SESSION-VERIFY method, which looks for the
session cookie, then for a GET parameter of that name."
  (find-method #'hunchentoot:session-verify '() (list (find-class 'hunchentoot:request))))

(defun parse-query-string (query-string)
  "The GET parameters of QUERY-STRING as Hunchentoot's request initializer
parses them when the request names no charset: UTF-8, an invalid sequence
decoded as #\\?."
  (let ((flex:*substitution-char* #\?))
    (hunchentoot::form-url-encoded-list-to-alist (cl-ppcre:split "&" query-string)
                                                 hunchentoot::+utf-8+)))

(defun parse-cookie-header (cookie-header)
  "The cookies of the Cookie header value COOKIE-HEADER, as Hunchentoot's
request initializer parses them."
  (hunchentoot::cookies-to-alist (cl-ppcre:split "\\s*[,;]\\s*" cookie-header)))

(defun request-slot-role (slot-name)
  "What the engine's request constructor puts in HUNCHENTOOT:REQUEST's slot
SLOT-NAME besides its initarg or initform: :SCRIPT-NAME, :QUERY-STRING,
:GET-PARAMETERS or :COOKIES-IN, or NIL."
  (case slot-name
    (hunchentoot:script-name :script-name)
    (hunchentoot:query-string :query-string)
    (hunchentoot:get-parameters :get-parameters)
    (hunchentoot:cookies-in :cookies-in)))

;;; Hunchentoot's sessions, for the session stores (sessions/): a session's
;;; fields that Hunchentoot does not export, a session made from a store's
;;; row, and its own session string.

(defun session-string (session)
  "The secret part of SESSION's cookie value, after the id and the colon."
  (hunchentoot::session-string session))

(defun session-data (session)
  "SESSION's values: an alist of each key symbol and its value."
  (hunchentoot::session-data session))

(defun session-last-click (session)
  "The universal time SESSION was last used."
  (hunchentoot::session-last-click session))

(defun (setf session-last-click) (time session)
  (setf (slot-value session 'hunchentoot::last-click) time))

(defun fill-session-identity (session id string)
  "SESSION, made by ALLOCATE-INSTANCE, with its id and session string set."
  (setf (slot-value session 'hunchentoot::session-id) id
        (slot-value session 'hunchentoot::session-string) string)
  session)

(defun fill-session (session &key id string user-agent remote-addr start last-click data max-time)
  "SESSION, an instance of a subclass of HUNCHENTOOT:SESSION made by
ALLOCATE-INSTANCE, with every field Hunchentoot's session has set."
  (fill-session-identity session id string)
  (setf (slot-value session 'hunchentoot::user-agent) user-agent
        (slot-value session 'hunchentoot::remote-addr) remote-addr
        (slot-value session 'hunchentoot::session-start) start
        (slot-value session 'hunchentoot::last-click) last-click
        (slot-value session 'hunchentoot::session-data) data
        (slot-value session 'hunchentoot::max-time) max-time)
  session)

(defun session-field-slot-p (slot-name)
  "True when SLOT-NAME names one of the fields FILL-SESSION sets."
  (member slot-name '(hunchentoot::session-id hunchentoot::session-string hunchentoot::user-agent
                      hunchentoot::remote-addr hunchentoot::session-start hunchentoot::last-click
                      hunchentoot::session-data hunchentoot::max-time)))

(defun session-string-for (id user-agent remote-addr start)
  "The session string Hunchentoot makes for a session with ID, started at
START by a client with USER-AGENT and REMOTE-ADDR, under the current
HUNCHENTOOT:*SESSION-SECRET*."
  (hunchentoot::encode-session-string id user-agent remote-addr start))

(defun access-log-time-text (universal-time)
  "UNIVERSAL-TIME as Hunchentoot's access log entry writes it (its ISO-TIME:
local time, to the second)."
  (hunchentoot::iso-time universal-time))
