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

(defmethod hunchentoot:acceptor-log-access :around ((acceptor parallel-acceptor) &key return-code)
  "The access log entry, written by the engine when Hunchentoot's method is
the only one (WRITE-ACCESS-LOG-ENTRY: the same entry), else by the methods
below; one that fails costs its entry and a line in the message log, never
the reply (NOTING-ACCESS-LOG-FAILURE)."
  (noting-access-log-failure (acceptor return-code)
    (if (engine-writes-access-log-p acceptor)
        (write-access-log-entry acceptor return-code)
        (call-next-method))))

(defvar *ascii-compatible-format* (list nil nil)
  "The last external format ASCII-COMPATIBLE-FORMAT-P was asked about, and
its answer: handlers use the same one again and again.")

(defun ascii-compatible-format-p (external-format)
  "True when EXTERNAL-FORMAT, a flexi-streams external format, encodes each
ASCII character as its code, one octet, a newline included."
  (remembering-last-answer (*ascii-compatible-format* external-format)
    (and (eq (flex:external-format-eol-style external-format) :lf)
         (member (flex:external-format-name external-format) '(:utf-8 :iso-8859-1 :latin-1 :ascii :us-ascii))
         t)))

(defconstant +coalesced-body-bytes+ 16384
  "A body of at most these octets goes into the head's buffer, so that head
and body leave in one send(2).")

(defun ascii-string-p (string)
  "True when every character of STRING is ASCII."
  (with-string-kind (string)
    (every (lambda (char) (< (char-code char) 128)) string)))

(defvar *url-rewrite-content-type* (list nil nil nil)
  "The last content type and HUNCHENTOOT:*CONTENT-TYPES-FOR-URL-REWRITE*
URL-REWRITE-CONTENT-TYPE-P was asked about, and its answer: handlers set the
same literal content type again and again.")

(defun url-rewrite-content-type-p (content-type)
  "True when START-OUTPUT rewrites the links of a string body of
CONTENT-TYPE for a session: it starts with one of
HUNCHENTOOT:*CONTENT-TYPES-FOR-URL-REWRITE*, case counting."
  (let ((prefixes hunchentoot:*content-types-for-url-rewrite*))
    (remembering-last-answer (*url-rewrite-content-type* content-type prefixes)
      (let ((text (or content-type "")))
        (and (some (lambda (prefix)
                     (and (<= (length prefix) (length text))
                          (string= prefix text :end2 (length prefix))))
                   prefixes)
             t)))))

(defun reply-body (content)
  "CONTENT, a string or octets, as the body SEND-REPLY-PIECES sends: octets,
or a string of at most +COALESCED-BODY-BYTES+ ASCII characters, whose codes
are its octets, left as it is to be written with the head (no octets are
made for it).  A string is first rewritten for a session that came without
its cookie, and then encoded in the reply's external format, and the
charset added to a text content type, as START-OUTPUT does; an ASCII string
in a format that writes ASCII as itself is not encoded by flexi-streams,
whose generic encoder cost 2% of a 0 ms request."
  (if (stringp content)
      (let ((content-type (hunchentoot:content-type*))
            (external-format (hunchentoot:reply-external-format*)))
        (when (url-rewrite-content-type-p content-type)
          (setf content (rewrite-urls-for-session content)))
        (setf (reply-header :content-type (slot-reply))
              (content-type-with-charset content-type external-format))
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
alist) but those named in OMITTED, the reply's cookies and the blank line.
True when a value written has a CR, LF or NUL.  A head of keyword names
and only values the engine made (MADE-HEADER-VALUE-OCTETS) or numbers, with
no cookie and none left out, is kept in HEAD and copied whole while the
next replies have the same (REMEMBERED-HEAD-OCTETS): most replies of a
second have the head of the one before, and building it was some 6% of a
0 ms request's user time (bench/profiles/2026-12-04-remembered-heads.txt)."
  (let* ((cookies (hunchentoot:cookies-out*))
         (whole-p (and (null omitted) (null cookies)))
         (remembered (and whole-p (remembered-head-octets head return-code headers))))
    (setf (reply-head-end head) 0)
    (if remembered
        (progn (push-octets remembered head) nil)
        (let ((unsafe-p nil)
              (rememberable whole-p))
          (push-octets (status-line return-code) head)
          (loop for (name . value) in headers
                when (and value (not (member name omitted)))
                  do (let ((octets (made-header-value-octets value)))
                       (unless (and (or octets (typep value 'fixnum)) (keywordp name))
                         (setf rememberable nil))
                       (when (push-header-line name value head octets)
                         (setf unsafe-p t))))
          (loop for (nil . cookie) in cookies
                do (when (push-header-line "Set-Cookie" (cookie-header-value cookie) head)
                     (setf unsafe-p t)))
          (push-crlf head)
          (when (and rememberable (not unsafe-p))
            (remember-head head return-code headers))
          unsafe-p))))

(defun made-header-value-octets (value)
  "The octets of VALUE when it is a header value the engine made and hands
to no one to change -- the Date of this second, the Server and Keep-Alive
of the worker's acceptor, the content type a charset was last added to, a
Connection START-OUTPUT sets -- made with it; else NIL.  Most of a common
reply's head is then copied whole, not character by character."
  (or (date-header-octets value)
      (charset-added-content-type-octets value)
      (and *serving*
           (cond ((eq value (serving-server-header-value *serving*)) (serving-server-header-octets *serving*))
                 ((eq value (serving-keep-alive-header-value *serving*)) (serving-keep-alive-header-octets *serving*))))
      (connection-header-value-octets value)))

(defun write-reply-head (return-code head omitted slot-reply)
  "Mark the current reply's headers sent and make HEAD its head
(PUSH-REPLY-HEAD), without the headers named in OMITTED; then write its
access log entry.  A value that would end its line is refused first
(REFUSE-UNSAFE-HEADER-VALUES), as it is read or as it is written, and the
reply that is not sent is not logged.  SLOT-REPLY: see SLOT-REPLY."
  (let ((reply hunchentoot:*reply*))
    (multiple-value-bind (headers unchecked-p) (headers-to-send reply slot-reply)
      (when (and (push-reply-head return-code headers head omitted) unchecked-p)
        (refuse-unsafe-header-values reply)))
    (log-access return-code)))

(defun build-reply-head (request return-code content-length)
  "Build RETURN-CODE's status line and the headers, for a body of
CONTENT-LENGTH octets, in the worker's REPLY-HEAD: headers as START-OUTPUT
sets them, the access log entry and the reading of an unread body as
SEND-RESPONSE does.  Returns the REPLY-HEAD."
  (let ((head (if *serving* (serving-reply-head *serving*) (make-reply-head)))
        (slot-reply (slot-reply)))
    (prefetch-remembered-head head)
    (set-connection-headers request slot-reply)
    (set-server-and-date-headers slot-reply)
    (setf (reply-header :content-length slot-reply) content-length)
    (write-reply-head return-code head '() slot-reply)
    ;; Hunchentoot reads what is left of the body here; a request without
    ;; one leaves nothing to read, and asking cost a percent of a request.
    (when (request-has-body-p (hunchentoot:headers-in request))
      (hunchentoot:raw-post-data :request request :force-binary t))
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

(defun send-reply-pieces (request return-code content-length body &optional file-fd owned-body-p)
  "Send RETURN-CODE's head (see BUILD-REPLY-HEAD) for a body of
CONTENT-LENGTH octets, then BODY: NIL, octets (the engine's own copy, no
one's after, when OWNED-BODY-P: counted in the memory budget while it
waits for the client), a string of REPLY-BODY's, or a list of pieces whose
file pieces are read from FILE-FD, which stays the caller's.  On a plain connection the reply is sent without waiting and
what the socket does not take is left to the engine, which sends it when
the client reads; a string, or octets up to +COALESCED-BODY-BYTES+, go in
the head's buffer, and such a reply waits in the worker's batch when the
worker's last request was quick (reply-batch.lisp).  Elsewhere it is
written to the current connection stream.  True when the body went whole
or will; false when the client has gone or the file ended early."
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
          (or (and (null body) (not (worker-last-request-long-p (serving-worker *serving*)))
                   (batch-reply (serving-reply-batch *serving*) connection
                                (reply-head-octets head) (reply-head-end head)))
              (send-reply-without-waiting (serving-set *serving*) connection
                                          (reply-head-octets head) (reply-head-end head) body file-fd
                                          owned-body-p)))
        (let ((stream (current-connection-stream)))
          (write-sequence (reply-head-octets head) stream :end (reply-head-end head))
          (write-reply-body (if (stringp body) (ascii-string-octets body) body) file-fd stream)))))

(defun send-octets-reply (request return-code content)
  "Send RETURN-CODE with the body CONTENT, a string or octets, head and
body as octets (SEND-REPLY-PIECES), coded as the client accepts
(CODE-REPLY-BODY).  No body for HEAD, and its headers GET's."
  (let ((body (code-reply-body request return-code (reply-body content))))
    (unless (send-reply-pieces request return-code (length body)
                               (unless (eq (hunchentoot:request-method request) :head) body)
                               nil (not (eq body content)))
      (setf (finish-processing-connection-p) t))))

(defun send-head-only (return-code omitted)
  "Send RETURN-CODE's status line, the headers as set, Server, Date and
cookies, but those named in OMITTED, and no body: the head of a reply whose
connection becomes something else.  Logged as any reply."
  (let ((head (serving-reply-head *serving*))
        (stream (current-connection-stream))
        (slot-reply (slot-reply)))
    (set-server-and-date-headers slot-reply)
    (write-reply-head return-code head omitted slot-reply)
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
message, unless the reply has begun.  The engine's refusal of what the
handler asked (SERVING-REFUSAL), which a client can make at every request,
is logged as its one line, without the backtrace."
  (let ((backtrace (and (not (and *serving* (shiftf (serving-refusal *serving*) nil))) backtrace)))
    (when hunchentoot:*log-lisp-errors-p*
      (hunchentoot:log-message* hunchentoot:*lisp-errors-log-level* "~A~@[~%~A~]"
                                error (and hunchentoot:*log-lisp-backtraces-p* backtrace)))
    (send-reply request hunchentoot:+http-internal-server-error+
                (hunchentoot:acceptor-status-message hunchentoot:*acceptor* hunchentoot:+http-internal-server-error+
                                                     :error (princ-to-string error)
                                                     :backtrace (princ-to-string backtrace)))))

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
                     (abandon-held-reply (serving-set *serving*) (worker-connection (serving-worker *serving*))
                                         (or (serving-deferred *serving*) (serving-event-stream *serving*)))
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
