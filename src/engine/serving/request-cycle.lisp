;;;; The request cycle: what a worker does with a connection it has taken
;;;; up.  It sends the rest of the connection's last reply, then answers
;;;; every request whose head has arrived, reading the bodies that follow
;;;; the heads, as Hunchentoot's own PROCESS-CONNECTION would -- its
;;;; specials, PROCESS-REQUEST, RESET-CONNECTION-STREAM -- until the
;;;; connection has to wait or end.  Every function of the cycle returns one
;;;; of these outcomes, with its detail:
;;;;
;;;;   :NEXT end       A request was answered and the connection stays open.
;;;;                   The next request's octets start the worker's buffer,
;;;;                   END of them (0: none yet).  Never the end of a turn:
;;;;                   the cycle goes on to that request.
;;;;   :DEFER end      The handler deferred its reply (DEFER-REPLY): wait for
;;;;                   it; END octets of the next request start the buffer.
;;;;   :EVENT-STREAM   The reply became an event stream, its head sent.
;;;;   :UPGRADE end    A websocket handshake was answered 101: the
;;;;                   connection becomes a websocket, END octets of its
;;;;                   first frames starting the buffer.
;;;;   :HTTP2 end      The connection speaks HTTP/2 (ALPN chose h2, or it
;;;;                   opened with the preface): END octets of its frames
;;;;                   start the buffer (http2-streams.lisp).
;;;;
;;;; or one of the outcomes a turn ends with (readiness/face.lisp): :PARK,
;;;; :READ-BODY, :SEND-REST, :CLOSE, :LET-GO, :REFUSE.  PROCESS-CONNECTION
;;;; (connections.lisp) hands the outcome of the turn to END-TURN.  The
;;;; worker's buffer is never an argument of these functions, whose frames a
;;;; handler's backtrace shows: it holds other clients' octets.

(in-package #:hunchentoot-recycling-taskmaster)

;;; One request.

(defun send-continue-reply (stream)
  "Write a 100 Continue to STREAM, the connection's, and finish it: a reply
the engine sends itself on the socket would overtake output left in it."
  (write-sequence *continue-reply* stream)
  (finish-output stream))

(defun end-reply (serving stream status)
  "After the reply to the current request, of STATUS, on the connection
whose stream is STREAM: finish its output and reset the connection stream
as Hunchentoot does; what follows, :LET-GO, :UPGRADE, :CLOSE or :NEXT."
  ;; Neither touches the stream after a reply the engine sent on a plain
  ;; connection's own stream when only Hunchentoot's method resets it: at
  ;; 1,000 connections the stream is cold.
  (unless (serving-reply-sent-p serving)
    (finish-output (current-connection-stream)))
  (unless (and (serving-reply-connection serving)
               (eq (current-connection-stream) stream)
               (not (serving-plain-streams-reset-p serving)))
    (setf (current-connection-stream)
          (hunchentoot:reset-connection-stream (serving-acceptor serving) (current-connection-stream))))
  (cond ((not (close-connection-stream-p)) :let-go)
        ((and (serving-upgrade serving) (eql status hunchentoot:+http-switching-protocols+))
         :upgrade)
        ((finish-processing-connection-p) :close)
        (t :next)))

(defun answer-request (serving connection head content-stream chunked-p continue-p)
  "Answer the request whose REQUEST-HEAD is HEAD: make its request object,
process it with Hunchentoot's specials bound, flush the reply and reset the
connection stream.  Its body is read from CONTENT-STREAM; CHUNKED-P says
that stream decodes a chunked body, and it is then also the stream the
reply is written to, which is how Hunchentoot tells that the body is
chunked.  A 100 Continue goes first when CONTINUE-P.  Returns :NEXT (the
caller finds where the next request starts), :UPGRADE (the same, for a
websocket's frames), :DEFER (the same, for a deferred reply), :CLOSE,
:LET-GO, or :REFUSE and a status (a chunked body refused before the reply
began)."
  (let ((acceptor (serving-acceptor serving))
        (taskmaster (engine-taskmaster (serving-engine serving)))
        (worker (serving-worker serving))
        (stream (connection-stream connection))
        (microseconds 0)
        (outcome nil)
        (status nil))
    (unless (note-request-started taskmaster worker)
      (return-from answer-request :close))
    (unwind-protect
         (handler-bind ((error
                          (lambda (condition)
                            (declare (ignore condition))
                            ;; Escaping Hunchentoot, a refused chunked body
                            ;; comes wrapped in USOCKET conditions: the stream
                            ;; tells.
                            (let ((refusal (unanswered-body-refusal content-stream chunked-p)))
                              (when refusal
                                (return-from answer-request (values :refuse refusal)))))))
           (when continue-p
             (send-continue-reply stream))
           (begin-request-state serving (and (not chunked-p) (plain-connection-p connection) connection))
           (with-request-bindings ()
             (setf (current-connection-stream) (if chunked-p content-stream stream))
             (let ((reply (make-reply (serving-constructors serving)
                                      (serving-plain-header-methods-p serving))))
               (let ((hunchentoot:*reply* reply)
                     (hunchentoot:*session* nil))
                 (flet ((process-request ()
                          (hunchentoot:process-request
                           (make-request (serving-constructors serving) acceptor head
                                         (connection-addresses connection) content-stream))))
                   ;; On the stack: a closure made for every request.
                   (declare (dynamic-extent #'process-request))
                   (call-with-request-counted acceptor (serving-requests-in-progress-location serving)
                                              #'process-request)))
               (setf status (hunchentoot:return-code reply)
                     outcome (cond ((serving-deferred serving) :defer)
                                   ((and (serving-event-stream serving) (eql status hunchentoot:+http-ok+))
                                    :event-stream)
                                   (t (end-reply serving stream status)))))))
      (setf (serving-reply-connection serving) nil)
      ;; Also when the request failed: a soft STOP waits for it.
      (setf microseconds (note-request-finished taskmaster worker :answered (and outcome t))))
    (unless (eq outcome :defer)
      (note-answered-request (serving-set serving) connection (serving-counter-stripe serving) status microseconds))
    outcome))

;;; A request whose body arrives after its head.

(defun answer-arrived-body (serving connection)
  "Read what has arrived of CONNECTION's ARRIVING-BODY; once it is whole,
answer its request.  :READ-BODY while more is to come; :REFUSE 500 when it
could not be stored, 400 or 413 when its chunked framing is refused;
:CLOSE when the client left; else the request's outcome, with the octets
read past a chunked body's end as the next request's."
  (let ((acceptor (serving-acceptor serving))
        (buffer (serving-buffer serving)))
    (multiple-value-bind (state detail head body-stream chunked-p)
        (handler-case (receive-arriving-body connection buffer (acceptor-body-buffer-bytes acceptor))
          (request-body-not-stored (condition)
            (log-safely acceptor :error "~A" condition)
            (return-from answer-arrived-body (values :refuse 500))))
      (ecase state
        (:would-block :read-body)
        (:closed :close)
        (:refuse (values :refuse detail))
        (:whole
         (multiple-value-bind (outcome status)
             (unwind-protect
                  (answer-request serving connection head
                                  (if chunked-p
                                      ;; The reply goes through it too.
                                      (make-chunked-body-stream
                                       (make-two-way-stream body-stream (connection-stream connection))
                                       (acceptor-max-body-bytes acceptor))
                                      body-stream)
                                  chunked-p nil)
               (discard-arriving-body (serving-set serving) connection))
           (if (member outcome '(:next :defer))
               (progn (replace buffer detail)
                      (values outcome (length detail)))
               (values outcome status))))))))

(defun start-reading-body (serving connection head length framing head-end end)
  "Make the body of HEAD (LENGTH octets, or chunked as FRAMING follows),
whose first octets lie in the buffer from HEAD-END below END, CONNECTION's
ARRIVING-BODY, after a 100 Continue if its client waits for one; then read
what has arrived of it (ANSWER-ARRIVED-BODY).  The body keeps a copy of
HEAD, the worker's, which the next request it serves fills."
  (when (expects-continue-p head)
    (send-continue-reply (connection-stream connection)))
  (start-arriving-body (serving-set serving) connection (copy-request-head head) length framing
                       (serving-buffer serving) head-end end)
  (answer-arrived-body serving connection))

(defun body-still-arriving-p (headers head-end end)
  "True when HEADERS declare a Content-Length body that has not all arrived
in the buffer, whose head ends at HEAD-END and octets at END."
  (let ((content-length (cdr (assoc :content-length headers))))
    (and content-length (> (parse-integer content-length) (- end head-end)))))

(defun arriving-chunk-framing (headers buffer head-end end max-body-bytes)
  "When HEADERS declare a chunked body whose end is not among the octets of
BUFFER from HEAD-END below END, the CHUNK-FRAMING that has followed them;
when its framing there is refused, NIL and the status to refuse the
request with (400, 413), before any handler reads it; else NIL (no
chunked body, or all of it is there)."
  (when (assoc :transfer-encoding headers)
    (let ((framing (make-chunk-framing max-body-bytes)))
      (multiple-value-bind (state status) (scan-chunk-framing framing buffer head-end end)
        (case state
          (:incomplete framing)
          (:refuse (values nil status)))))))

;;; A complete head in the buffer.

(defun answer-head (serving connection request-start request-line-end head-end end)
  "Answer the request whose complete head lies in the buffer from
REQUEST-START (its request line's LF at REQUEST-LINE-END) below HEAD-END,
END octets having arrived in all, or begin reading its body."
  (let* ((buffer (serving-buffer serving))
         (acceptor (serving-acceptor serving))
         (head (handler-case (parse-request-head buffer request-start request-line-end head-end
                                                 (serving-name-scratch serving) (serving-request-head serving))
                 (request-head-refused (condition)
                   ;; A line naming no HTTP version, where HTTP/2 is spoken
                   ;; too, may be a broken preface (END-TURN tells).
                   (return-from answer-head
                     (values :refuse (if (and (serving-http2-p serving) (not (refused-head-http-p condition)))
                                         :not-http
                                         (refused-status condition)))))))
         (headers (request-head-headers head))
         (max-body-bytes (serving-max-body-bytes serving))
         (framing nil)
         (framing-refusal nil))
    (cond ((memory-budget-exceeded-p (serving-budget serving))
           ;; No new work while what was counted as it came passes the budget.
           (values :refuse :memory))
          ((and (assoc :transfer-encoding headers)
                (not (hunchentoot:acceptor-input-chunking-p acceptor)))
           ;; This acceptor takes no chunked body: RFC 9112 6.3 says 411.
           (values :refuse 411))
          ((body-over-limit-p headers max-body-bytes)
           ;; Refused before a 100 Continue, so the client need not send it.
           (values :refuse 413))
          ((body-still-arriving-p headers head-end end)
           (start-reading-body serving connection head (parse-integer (cdr (assoc :content-length headers)))
                               nil head-end end))
          ((progn (setf (values framing framing-refusal)
                        (arriving-chunk-framing headers buffer head-end end max-body-bytes))
                  framing-refusal)
           ;; Refused before dispatch: a client's mistake costs no handler
           ;; and no backtrace.
           (values :refuse framing-refusal))
          (framing
           (start-reading-body serving connection head nil framing head-end end))
          (t
           (let* ((body-p (request-has-body-p headers))
                  (chunked-p (and body-p (assoc :transfer-encoding headers) t))
                  ;; Where a Content-Length body ends, all of it in the buffer.
                  (body-end (if (and body-p (not chunked-p))
                                (+ head-end (parse-integer (cdr (assoc :content-length headers))))
                                head-end)))
             (when chunked-p
               ;; Read through the connection stream, which may leave
               ;; octets on the socket that no new edge will report.
               (note-input-read-by-stream connection))
             (multiple-value-bind (content-stream buffered)
                 (if body-p
                     (content-stream-for chunked-p (connection-stream connection) buffer head-end
                                         (if chunked-p end body-end))
                     (connection-stream connection))
               (multiple-value-bind (outcome status)
                   (answer-request serving connection head content-stream chunked-p (expects-continue-p head))
                 (if (member outcome '(:next :upgrade :defer))
                     ;; A chunked body read only in part leaves no way to
                     ;; find where the next request starts.
                     (let ((next-end (and (or (not chunked-p) (body-finished-p content-stream))
                                          (next-request-octets connection buffer chunked-p buffered body-end end))))
                       (if next-end (values outcome next-end) :close))
                     (values outcome status)))))))))

;;; A turn.

(defun answer-arrived-requests (serving connection)
  "Send the rest of CONNECTION's last reply, then answer every request it
has sent so far, reading the bodies that follow their heads, until the
connection has to wait or end: the outcome of the turn, never :NEXT."
  (let* ((buffer (serving-buffer serving))
         (http2-p (serving-http2-p serving))
         (max-header-bytes (serving-max-header-bytes serving))
         (end (take-pending-bytes connection buffer (serving-budget serving))))
    (case (send-rest-of-reply (serving-set serving) connection)
      (:would-block (return-from answer-arrived-requests (values :send-rest end)))
      (:close (return-from answer-arrived-requests :close)))
    (loop
      (when (plusp end)
        ;; A reply waiting in the worker's batch goes before anything of
        ;; the next request, whose handler, or 100 Continue, may write to
        ;; the stream itself.
        (unless (send-batched-reply connection)
          (return :close))
        (when (follow-reply-rest-with connection :keep-alive)
          (return (values :send-rest end))))
      (multiple-value-bind (outcome detail)
          (if (connection-arriving-body connection)
              (answer-arrived-body serving connection)
              (case (and http2-p (connection-http2-state connection buffer end))
                (:http2 (values :http2 end))
                (:partial (values :park end))
                (t (multiple-value-bind (status request-start request-line-end head-end)
                       (scan-request-head buffer 0 end max-header-bytes)
                     (case status
                       (:complete (answer-head serving connection request-start request-line-end head-end end))
                       (:incomplete (values :park end))
                       (t (values :refuse status)))))))
        (case outcome
          (:park
           ;; Read what else has come before parking.
           (let ((count (receive-bytes connection buffer end (length buffer))))
             (cond ((eq count :would-block) (return (values :park end)))
                   ((or (eq count :error) (zerop count)) (return :close))
                   (t (note-head-octets connection)
                      (incf end count)))))
          (:next
           (setf end detail)
           (when (plusp end)
             (note-head-octets connection))
           (when (follow-reply-rest-with connection :keep-alive)
             (return (values :send-rest end)))
           (when (zerop end)
             ;; Trying one more read before parking did not pay (bench
             ;; run 2026-11-22T004655Z): a kept-alive connection parks.
             (return (values :park 0))))
          ((:upgrade :defer :http2) (return (values outcome detail)))
          ((:close :let-go)
           (when (follow-reply-rest-with connection :close)
             (return (values :send-rest 0)))
           (return outcome))
          (t (return (values outcome detail))))))))
