;;;; Replies.  A parallel acceptor's requests are processed by the engine's
;;;; own HUNCHENTOOT:PROCESS-REQUEST method, which does what Hunchentoot's
;;;; does -- the handler's specials, errors reported as 500, the status
;;;; message for a handler that returned nothing, temporary files removed --
;;;; except for the common reply: when the handler returned its body as a
;;;; string or octets, the status line, headers and body are written to
;;;; the connection as octets, headers computed as START-OUTPUT computes
;;;; them, without a flexi-stream or FORMAT per header line (bench/profiles:
;;;; a fifth of the samples of a trivial request went there).  Every other
;;;; reply -- handlers that stream through SEND-HEADERS, bodiless replies
;;;; such as 304, HTML rewritten for cookie-less sessions, a
;;;; HUNCHENTOOT:*HEADER-STREAM* to copy headers to -- is Hunchentoot's.

(in-package #:hunchentoot-recycling-taskmaster)

(defmethod hunchentoot:headers-out :around ((reply parallel-reply))
  "The headers as they are read to be written (the headers are then marked
sent: HUNCHENTOOT:START-OUTPUT marks them just before it reads them),
refused when a value is unsafe (REFUSE-UNSAFE-HEADER-VALUES), and with
Keep-Alive naming the acceptor's KEEP-ALIVE-TIMEOUT: START-OUTPUT writes
timeout=<read timeout> when a client asks to be kept alive, but a parallel
acceptor closes an idle connection after KEEP-ALIVE-TIMEOUT, and a client
told otherwise would send its next request on a connection being closed.
Hunchentoot's (SETF HEADER-OUT) cannot be specialized on the reply, its
optional argument: hence the reader."
  (when (and (headers-sent-p) *serving* (not *deciding-reply-coding*)
             (acceptor-compression hunchentoot:*acceptor*))
    ;; A streamed reply's head, about to be sent: coded from here on?
    (let ((*deciding-reply-coding* t))
      (code-streamed-reply hunchentoot:*request*)))
  (let ((headers (call-next-method)))
    (when (headers-sent-p)
      (refuse-unsafe-header-values reply)
      (let ((entry (and *serving* (assoc :keep-alive headers))))
        (when entry
          (setf (cdr entry) (serving-keep-alive-header-value *serving*)))))
    headers))

(defmethod hunchentoot:acceptor-log-access :around ((acceptor parallel-acceptor) &key return-code)
  "The access log entry, written as the methods below write it, just before
the reply; one that fails costs its entry and a line in the message log,
never the reply.  Hunchentoot's own fails on a client's Authorization
header whose Basic credentials are not base64 (HUNCHENTOOT:AUTHORIZATION
signals), and on its own acceptor that request then goes unanswered."
  (handler-case (call-next-method)
    (error (condition)
      (log-safely acceptor :warning "No access log entry for the ~D reply to ~A: ~A"
                  return-code
                  (and (boundp 'hunchentoot:*request*) hunchentoot:*request*
                       (hunchentoot:remote-addr hunchentoot:*request*))
                  condition))))

(defun connection-option-p (value option)
  "True when OPTION is one of the comma-separated options of the Connection
header VALUE, compared without case, as Hunchentoot's KEEP-ALIVE-P reads
them: whitespace around each comma is not part of an option, whitespace at
the ends of VALUE is."
  (declare (type simple-string option))
  (let ((value (if (simple-string-p value) value (coerce value 'simple-string)))
        (length (length option)))
    (flet ((whitespacep (char) (member char '(#\Space #\Tab #\Newline #\Return #\Page))))
      (loop with end = (length value)
            for start = 0 then (1+ comma)
            for comma = (or (position #\, value :start start) end)
            do (let ((option-start (if (plusp start)
                                       (or (position-if-not #'whitespacep value :start start :end comma) comma)
                                       start))
                     (option-end (if (< comma end)
                                     (1+ (or (position-if-not #'whitespacep value :start start :end comma :from-end t)
                                             (1- start)))
                                     comma)))
                 (when (and (= (- option-end option-start) length)
                            (string-equal value option :start1 option-start :end1 option-end))
                   (return t)))
            while (< comma end)))))

(defun keep-alive-reply-p (request)
  "What Hunchentoot's KEEP-ALIVE-P answers for REQUEST: true unless its
headers or the acceptor forbid a persistent connection; second value, true
when the client asked for one explicitly.  Hunchentoot splits the
Connection header with a regular expression on every request; this reads it
in place."
  (let* ((value (hunchentoot:header-in :connection request))
         (keep-alive-requested-p (and value (connection-option-p value "keep-alive"))))
    (values (and (hunchentoot:acceptor-persistent-connections-p hunchentoot:*acceptor*)
                 (case (hunchentoot:server-protocol request)
                   (:http/1.1 (not (and value (connection-option-p value "close"))))
                   (:http/1.0 keep-alive-requested-p)))
            keep-alive-requested-p)))

(defun set-connection-headers (request)
  "Set the Connection and Keep-Alive headers and whether the connection
ends after this reply, as START-OUTPUT does for a reply whose length is
known."
  (let ((acceptor hunchentoot:*acceptor*))
    (multiple-value-bind (keep-alive-p keep-alive-requested-p) (keep-alive-reply-p request)
      (cond (keep-alive-p
             (setf (finish-processing-connection-p) nil)
             (when (and (hunchentoot:acceptor-read-timeout acceptor)
                        (or (not (eq (hunchentoot:server-protocol request) :http/1.1))
                            keep-alive-requested-p))
               (unless (hunchentoot:header-out :connection)
                 (setf (hunchentoot:header-out :connection) "Keep-Alive"))
               (setf (hunchentoot:header-out :keep-alive)
                     (if *serving*
                         (serving-keep-alive-header-value *serving*)
                         (format nil "timeout=~D" (hunchentoot:acceptor-read-timeout acceptor))))))
            ((not (header-out-set-p :connection))
             (setf (hunchentoot:header-out :connection) "Close"))))))

(defun set-server-and-date-headers ()
  (unless (and (header-out-set-p :server) (null (hunchentoot:header-out :server)))
    (setf (hunchentoot:header-out :server)
          (or (hunchentoot:header-out :server)
              (and *serving* (serving-server-header-value *serving*))
              (acceptor-server-name hunchentoot:*acceptor*))))
  (setf (hunchentoot:header-out :date) (date-header-value)))

(defvar *ascii-compatible-format* (list nil nil)
  "The last external format ASCII-COMPATIBLE-FORMAT-P was asked about, and
its answer: handlers use the same one again and again.")

(defun ascii-compatible-format-p (external-format)
  "True when EXTERNAL-FORMAT, a flexi-streams external format, encodes each
ASCII character as its code, one octet, a newline included."
  (destructuring-bind (last-format answer) *ascii-compatible-format*
    (if (eq external-format last-format)
        answer
        (let ((answer (and (eq (flex:external-format-eol-style external-format) :lf)
                           (member (flex:external-format-name external-format)
                                   '(:utf-8 :iso-8859-1 :latin-1 :ascii :us-ascii))
                           t)))
          (setf *ascii-compatible-format* (list external-format answer))
          answer))))

(defconstant +coalesced-body-bytes+ 16384
  "A body of at most these octets goes into the head's buffer, so that head
and body leave in one send(2).")

(defun ascii-string-p (string)
  "True when every character of STRING is ASCII."
  (with-string-kind (string)
    (every (lambda (char) (< (char-code char) 128)) string)))

(defun url-rewrite-content-type-p (content-type)
  "True when START-OUTPUT rewrites the links of a string body of
CONTENT-TYPE for a session: it starts with one of
HUNCHENTOOT:*CONTENT-TYPES-FOR-URL-REWRITE*, case counting."
  (let ((content-type (or content-type "")))
    (some (lambda (prefix)
            (and (<= (length prefix) (length content-type))
                 (string= prefix content-type :end2 (length prefix))))
          hunchentoot:*content-types-for-url-rewrite*)))

(defun reply-body (content)
  "CONTENT, a string or octets, as the body SEND-REPLY-PIECES sends: octets,
or a string of at most +COALESCED-BODY-BYTES+ ASCII characters, whose codes
are its octets, left as it is to be written with the head (no octets are
made for it).  A string is first rewritten for a session that came without
its cookie, and then encoded in the reply's external format, and the
charset added to a text content type, as START-OUTPUT does; an ASCII string
in a format that writes ASCII as itself is not encoded by flexi-streams,
whose generic encoder cost 2% of a 0 ms request."
  (when (and (stringp content) (url-rewrite-content-type-p (hunchentoot:content-type*)))
    (setf content (rewrite-urls-for-session content)))
  (if (stringp content)
      (let ((external-format (hunchentoot:reply-external-format*)))
        (setf (hunchentoot:content-type*)
              (content-type-with-charset (hunchentoot:content-type*) external-format))
        (cond ((not (and (ascii-compatible-format-p external-format) (ascii-string-p content)))
               (flex:string-to-octets content :external-format external-format))
              ((<= (length content) +coalesced-body-bytes+) content)
              (t (ascii-string-octets content))))
      (coerce content 'octets)))

;;; Writing it.

(defun octets-reply-p (content)
  "True when the reply with CONTENT is written as octets: a string or octet
body, headers not sent yet and no header stream to copy them to."
  (and (or (stringp content) (typep content '(vector (unsigned-byte 8))))
       (not (headers-sent-p))
       (null hunchentoot:*header-stream*)))

(defun push-reply-head (return-code headers head omitted)
  "Make HEAD, a REPLY-HEAD, RETURN-CODE's status line, the HEADERS (an
alist) but those named in OMITTED, the reply's cookies and the blank line."
  (setf (reply-head-end head) 0)
  (push-octets (status-line return-code) head)
  (loop for (name . value) in headers
        when (and value (not (member name omitted)))
          do (push-header-line (header-name-text name) value head))
  (loop for (nil . cookie) in (hunchentoot:cookies-out*)
        do (push-header-line "Set-Cookie" (cookie-header-value cookie) head))
  (push-crlf head))

(defun build-reply-head (request return-code content-length)
  "Build RETURN-CODE's status line and the headers, for a body of
CONTENT-LENGTH octets, in the worker's REPLY-HEAD: headers as START-OUTPUT
sets them, the access log entry and the reading of an unread body as
SEND-RESPONSE does.  Returns the REPLY-HEAD."
  (set-connection-headers request)
  (set-server-and-date-headers)
  (let ((head (if *serving* (serving-reply-head *serving*) (make-reply-head)))
        (reply hunchentoot:*reply*))
    (setf (hunchentoot:header-out :content-length) content-length
          (headers-sent-p) t)
    ;; Read once the headers are marked sent: a PARALLEL-REPLY's are checked
    ;; as they are read; any other's here.  Before the access log, which
    ;; would otherwise log a reply that is not sent.
    (let ((headers (hunchentoot:headers-out reply)))
      (unless (typep reply 'parallel-reply)
        (refuse-unsafe-header-values reply))
      (log-access return-code)
      ;; Hunchentoot reads what is left of the body here; a request without
      ;; one leaves nothing to read, and asking cost a percent of a request.
      (when (request-has-body-p (hunchentoot:headers-in request))
        (hunchentoot:raw-post-data :request request :force-binary t))
      (push-reply-head return-code headers head '()))
    head))

(defun engine-reply-connection ()
  "The plain connection a reply may be left to the engine on: the
current request's, when the handler neither detached it nor wrapped its
stream.  NIL otherwise."
  (let ((connection (and *serving* (serving-reply-connection *serving*))))
    (and connection
         (close-connection-stream-p)
         (eq (current-connection-stream) (connection-stream connection))
         connection)))

(defun send-reply-pieces (request return-code content-length body &optional file-fd)
  "Send RETURN-CODE's head (see BUILD-REPLY-HEAD) for a body of
CONTENT-LENGTH octets, then BODY: NIL, octets, a string of REPLY-BODY's,
or a list of pieces whose file pieces are read from FILE-FD, which stays
the caller's.  On a plain connection the reply is sent without waiting and
what the socket does not take is left to the engine, which sends it when
the client reads; a string, or octets up to +COALESCED-BODY-BYTES+, go in
the head's buffer.  Elsewhere it is written to the current connection
stream.  True when the body went whole or will; false when the client has
gone or the file ended early."
  (let ((head (build-reply-head request return-code content-length))
        (connection (engine-reply-connection)))
    (if connection
        (progn
          ;; The connection's stream holds no output to go first: the last
          ;; reply was finished and a 100 Continue too (ANSWER-REQUEST),
          ;; and a handler writes to it only after SEND-HEADERS, which
          ;; leaves the reply to Hunchentoot.
          (setf (serving-reply-sent-p *serving*) t)
          (typecase body
            (string (push-text body head)
             (setf body nil))
            (octets (when (<= (length body) +coalesced-body-bytes+)
                      (push-octets body head)
                      (setf body nil))))
          (send-reply-without-waiting (serving-set *serving*) connection
                                      (reply-head-octets head) (reply-head-end head) body file-fd))
        (let ((stream (current-connection-stream)))
          (write-sequence (reply-head-octets head) stream :end (reply-head-end head))
          (write-reply-body (if (stringp body) (ascii-string-octets body) body) file-fd stream)))))

(defun send-octets-reply (request return-code content)
  "Send RETURN-CODE with the body CONTENT, a string or octets, head and
body as octets (SEND-REPLY-PIECES), coded as the client accepts
(CODE-REPLY-BODY).  No body for HEAD, and its headers GET's."
  (let ((body (code-reply-body request return-code (reply-body content))))
    (unless (send-reply-pieces request return-code (length body)
                               (unless (eq (hunchentoot:request-method request) :head) body))
      (setf (finish-processing-connection-p) t))))

(defun send-head-only (return-code omitted)
  "Send RETURN-CODE's status line, the headers as set, Server, Date and
cookies, but those named in OMITTED, and no body: the head of a reply whose
connection becomes something else.  Logged as any reply."
  (set-server-and-date-headers)
  (setf (headers-sent-p) t)
  (let ((head (serving-reply-head *serving*))
        (reply hunchentoot:*reply*)
        (stream (current-connection-stream)))
    (let ((headers (hunchentoot:headers-out reply)))
      (unless (typep reply 'parallel-reply)
        (refuse-unsafe-header-values reply))
      (log-access return-code)
      (push-reply-head return-code headers head omitted))
    (write-sequence (reply-head-octets head) stream :end (reply-head-end head))
    (finish-output stream)))

(defun send-switching-protocols-reply ()
  "Send the 101 that makes the connection a websocket, without the
Content-Type, Content-Length and Keep-Alive of a reply with a body (RFC
9110 8.6: a 1xx has no Content-Length)."
  (send-head-only hunchentoot:+http-switching-protocols+ '(:content-type :content-length :keep-alive)))

(defun send-event-stream-head ()
  "Send the head that makes the connection an event stream: 200,
text/event-stream in UTF-8, not cached (unless the handler said otherwise)
nor buffered by a proxy, the body ending with the connection."
  (setf (hunchentoot:return-code*) hunchentoot:+http-ok+
        (hunchentoot:content-type*) "text/event-stream; charset=utf-8"
        (hunchentoot:header-out :x-accel-buffering) "no"
        (hunchentoot:header-out :connection) "close")
  (unless (hunchentoot:header-out :cache-control)
    (setf (hunchentoot:header-out :cache-control) "no-cache"))
  (send-head-only hunchentoot:+http-ok+ '(:content-length :keep-alive)))

(defun send-reply (request return-code content)
  "Send the reply: the 101 of a websocket handshake by
SEND-SWITCHING-PROTOCOLS-REPLY, as octets when OCTETS-REPLY-P, else by
Hunchentoot's START-OUTPUT."
  (cond ((and (eql return-code hunchentoot:+http-switching-protocols+) *serving* (serving-upgrade *serving*))
         (send-switching-protocols-reply))
        ((and *serving* (serving-event-stream *serving*))
         (send-event-stream-head))
        ((octets-reply-p content)
         (send-octets-reply request return-code content))
        (t (hunchentoot-start-output return-code content))))

;;; Processing a request.

(defun report-handler-error (request error &optional backtrace)
  "Log ERROR as Hunchentoot does and answer 500 with the acceptor's status
message, unless the reply has begun."
  (when hunchentoot:*log-lisp-errors-p*
    (hunchentoot:log-message* hunchentoot:*lisp-errors-log-level* "~A~@[~%~A~]"
                              error (and hunchentoot:*log-lisp-backtraces-p* backtrace)))
  (send-reply request hunchentoot:+http-internal-server-error+
              (hunchentoot:acceptor-status-message hunchentoot:*acceptor* hunchentoot:+http-internal-server-error+
                                                   :error (princ-to-string error)
                                                   :backtrace (princ-to-string backtrace))))

(defmethod hunchentoot:process-request ((request parallel-request))
  "Under a PARALLEL-ACCEPTOR, Hunchentoot's request processing with the
common reply written as octets (see engine/reply.lisp); under any other
acceptor, Hunchentoot's own."
  (if (not (typep hunchentoot:*acceptor* 'parallel-acceptor))
      (call-next-method)
      (catching-request-end
        (with-request-specials (request)
          (unwind-protect
               (usocket:with-mapped-conditions ()
                 (multiple-value-bind (contents error backtrace)
                     ;; A request its initializer found bad has its 400 already.
                     (when (eql (hunchentoot:return-code*) hunchentoot:+http-ok+)
                       (catching-handler-end
                         (hunchentoot:handle-request hunchentoot:*acceptor* request)))
                   (when (hunchentoot:acceptor-ssl-p hunchentoot:*acceptor*)
                     ;; The reply goes through OpenSSL.
                     (forget-tls-errors))
                   (when (and error (or (serving-deferred *serving*) (serving-event-stream *serving*)))
                     ;; Answered as the failure says, never completed.
                     (abandon-held-reply (serving-set *serving*) (worker-connection (serving-worker *serving*)))
                     (setf (serving-deferred *serving*) nil
                           (serving-event-stream *serving*) nil))
                   (when error
                     (report-handler-error request error backtrace))
                   (unless (or (headers-sent-p) (serving-deferred *serving*))
                     (handler-case
                         (with-hunchentoot-debugger
                           (send-reply request (hunchentoot:return-code*)
                                       (or contents
                                           (hunchentoot:acceptor-status-message hunchentoot:*acceptor*
                                                                                (hunchentoot:return-code*)))))
                       (error (condition)
                         (report-handler-error request condition))))))
            (delete-request-temporary-files))))))

(defun send-completed-reply (request status headers body)
  "Send the reply to REQUEST that its handler deferred, completed with
STATUS, the HEADERS alist set on the reply, and BODY, as PROCESS-REQUEST
sends the reply a handler returned."
  (catching-request-end
    (with-request-specials (request)
      (setf (hunchentoot:return-code*) status)
      (loop for (name . value) in headers
            do (setf (hunchentoot:header-out name) value))
      (handler-case (with-hunchentoot-debugger (send-reply request status body))
        (error (condition)
          (report-handler-error request condition))))))
