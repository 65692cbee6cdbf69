;;;; The readiness engine.  Workers wait on the acceptor's readiness set;
;;;; woken for the listening socket a worker accepts a connection, woken for
;;;; a parked connection it takes it.  Either way it then serves the
;;;; connection inside HUNCHENTOOT:PROCESS-CONNECTION: it answers every
;;;; complete request head that has arrived and parks the connection again
;;;; -- with the bytes of a partial head, if any -- as soon as the socket has
;;;; nothing more.  A thread is held only while a head is parsed, a step of
;;;; a TLS handshake taken or a request answered.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +sweep-interval-seconds+ 1/4
  "How often parked connections whose deadline has passed are ended (the
precision of the header and keep-alive timeouts), and accepting resumes
after it paused.")

(defclass readiness-engine (connection-engine)
  ((set :initform nil :accessor engine-readiness-set
        :documentation "The READINESS-SET of the current run; NIL while the
acceptor is stopped.")
   (counters :initform (make-connection-counters) :reader engine-counters
             :documentation "What the readiness sets of every run have counted.")
   (object-constructors :initform nil :accessor engine-object-constructors
                        :documentation "The OBJECT-CONSTRUCTORS of the current run.")
   (tls-context :initform nil :accessor engine-tls-context
                :documentation "The TLS context (tls-handshake.lisp) of the
current run when the engine takes the acceptor's TLS handshakes, else NIL.")
   (sweep-buffer :initform nil :accessor engine-sweep-buffer
                 :documentation "Where the thread-making thread peeks at what has
arrived on parked connections while no worker is free (saturated-pool.lisp)."))
  (:documentation "The :READINESS-SET connection engine: one epoll set holding
the listening socket and every connection waiting for bytes, shared by
every worker."))

(defmethod make-connection-engine ((name (eql :readiness-set)) taskmaster)
  (make-instance 'readiness-engine :taskmaster taskmaster))

(defun engine-acceptor (engine)
  (hunchentoot:taskmaster-acceptor (engine-taskmaster engine)))

(defun stopping-p (engine)
  (or (shutting-down-p (engine-taskmaster engine))
      (acceptor-shutting-down-p (engine-acceptor engine))))

(defun milliseconds-until (deadline)
  (max 0 (ceiling (* 1000 (- deadline (get-internal-real-time))) internal-time-units-per-second)))

;;; Waiting for something to serve.

(defun next-ready-token (engine worker set)
  "Wait on SET until WORKER has something to serve: the token reported, or
NIL when WORKER is to end (the pool is stopping, or WORKER is surplus)."
  (let ((taskmaster (engine-taskmaster engine)))
    (note-waiting taskmaster worker)
    (flet ((idle-deadline ()
             (deadline-in (taskmaster-thread-idle-timeout taskmaster))))
      (let ((idle-deadline (idle-deadline)))
        (loop
          (when (shutting-down-p taskmaster)
            (note-stopped-waiting taskmaster worker)
            (return nil))
          (let ((token (epoll-wait-one (readiness-set-epoll-fd set) (milliseconds-until idle-deadline))))
            (case token
              (:interrupted)
              (:timeout
               (when (>= (get-internal-real-time) idle-deadline)
                 (when (note-wait-timed-out taskmaster worker)
                   (return nil))
                 (setf idle-deadline (idle-deadline))))
              (t
               ;; The wakeup descriptor means stop, seen at the top of the loop.
               (unless (= token +wakeup-token+)
                 (note-woken taskmaster worker)
                 (return token))))))))))

;;; Accepting.

(defun note-accept-failed (engine set condition)
  "accept(2) failed with CONDITION.  EMFILE and the like last until
connections close: pause accepting until the next sweep, as nginx turns its
accept events off for a moment, and log it (quiet while stopping)."
  ;; Once accepting has stopped, a worker woken just before may find the
  ;; socket no longer listening (REFUSE-CONNECTIONS): nothing to report.
  (unless (or (stopping-p engine) (readiness-set-accepting-stopped-p set))
    (call-with-spare-descriptor
     set (lambda ()
           (log-safely (engine-acceptor engine) :error "accept failed, accepting paused for a moment: ~A"
                       condition))))
  (pause-accepting set))

(defun accept-new-connection (engine set)
  "A new CONNECTION from SET's listening socket, :ACTIVE, or NIL."
  (let ((fd (handler-case (accept-connection-fd (readiness-set-listen-fd set))
              (error (condition)
                (note-accept-failed engine set condition)
                (return-from accept-new-connection nil)))))
    ;; Another worker may accept the next connection while this one serves.
    (rearm-listen-socket set)
    (when fd
      (count-accepted-connection set)
      (let ((connection (add-connection set fd (make-connection-fd-stream
                                                fd (hunchentoot:acceptor-read-timeout (engine-acceptor engine))))))
        (setf (connection-head-started connection) (get-internal-real-time))
        connection))))

(defun start-connection-stream (engine connection)
  "Read the new CONNECTION's addresses and start its stream.  On an SSL
acceptor that is the TLS handshake: taken by the engine as far as the
client's bytes allow (tls-handshake.lisp), or else inside
HUNCHENTOOT:INITIALIZE-CONNECTION-STREAM, waited for by the worker, bounded
by the read timeout and cut by STOP.  Returns T when CONNECTION can be
served; :INPUT or :OUTPUT when its handshake waits for the socket to be
readable or writable; NIL when the client has gone, the handshake failed or
the pool is stopping."
  (let ((addresses (or (connection-addresses connection)
                       (ignore-errors (connection-addresses-of (connection-fd connection))))))
    (when (and addresses (not (stopping-p engine)))
      (when (and (null (connection-addresses connection))
                 (typep (engine-acceptor engine) 'hunchentoot:ssl-acceptor))
        ;; TLS writes a reply as several records; Nagle's algorithm would
        ;; hold the last one until the client's delayed acknowledgement of
        ;; the first, 40 ms later.
        (send-small-writes-at-once (connection-fd connection)))
      (setf (connection-addresses connection) addresses)
      (let* ((context (engine-tls-context engine))
             (stream (if context
                         (continue-connection-handshake (engine-readiness-set engine) context connection)
                         (ignore-errors
                          (hunchentoot:initialize-connection-stream (engine-acceptor engine)
                                                                    (connection-fd-stream connection))))))
        (cond ((streamp stream)
               (setf (connection-stream connection) stream
                     (connection-socket connection) (make-connection-socket
                                                     connection (connection-fd-stream connection)))
               t)
              (t stream))))))

;;; Serving a connection the worker holds.

(defun serve-connection (engine worker set connection)
  "Serve CONNECTION, which the calling WORKER has taken from SET, inside
HUNCHENTOOT:PROCESS-CONNECTION.  Whatever way that ends, the connection is
parked, closed or let go afterwards."
  (hold-connection worker connection)
  (unless (plain-connection-p connection)
    (forget-tls-errors))
  (unwind-protect
       (let ((started (or (connection-socket connection) (start-connection-stream engine connection))))
         (case started
           ((:input :output)
            (when (let-go-of-connection worker)
              (park-during-handshake engine set connection started)))
           ((nil))
           (t (hunchentoot:process-connection (engine-acceptor engine) (connection-socket connection)))))
    ;; Still held: PROCESS-CONNECTION was left by an error, or an :AROUND
    ;; method did not call the next method.
    (when (let-go-of-connection worker)
      (close-connection set connection))))

(defun answer-parsed-request (engine worker connection head content-stream chunked-p continue-p)
  "Answer the request whose REQUEST-HEAD is HEAD, its body read from
CONTENT-STREAM (chunked when CHUNKED-P; then also the stream the reply is
written to), after a 100 Continue when CONTINUE-P.  Returns :KEEP-ALIVE,
:CLOSE, :LET-GO (a handler took the connection over), or :REFUSE and a
status (a chunked body refused before the reply began)."
  (let ((acceptor (engine-acceptor engine))
        (taskmaster (engine-taskmaster engine))
        (stream (connection-stream connection))
        (started (get-internal-real-time))
        (outcome nil)
        (status nil))
    (unless (note-request-started taskmaster worker)
      (return-from answer-parsed-request :close))
    (unwind-protect
         (handler-bind ((error
                          (lambda (condition)
                            (declare (ignore condition))
                            ;; Escaping Hunchentoot, a refused chunked body
                            ;; comes wrapped in USOCKET conditions: the stream
                            ;; tells.
                            (let ((refusal (unanswered-body-refusal content-stream chunked-p)))
                              (when refusal
                                (return-from answer-parsed-request (values :refuse refusal)))))))
           (when continue-p
             (write-sequence *continue-reply* stream)
             (force-output stream))
           (setf (values outcome status)
                 (let ((*reply-connection* (and (not chunked-p) (plain-connection-p connection) connection)))
                   (answer-request acceptor head (connection-addresses connection)
                                   stream content-stream chunked-p))))
      ;; Also when the request failed: a soft STOP waits for it.
      (note-request-finished taskmaster worker :answered (and outcome t)))
    (setf (connection-answered-p connection) t)
    (count-answered-request (engine-readiness-set engine) status started)
    (ecase outcome
      (:detached :let-go)
      ((:close :keep-alive) outcome))))

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

(defun start-reading-body (engine connection head length framing buffer head-end end)
  "Make the body of HEAD (LENGTH octets, or chunked as FRAMING follows) that
has begun to arrive in BUFFER from HEAD-END below END CONNECTION's
ARRIVING-BODY, after a 100 Continue if its client waits for one."
  (when (expects-continue-p head)
    (write-sequence *continue-reply* (connection-stream connection))
    (force-output (connection-stream connection)))
  (start-arriving-body (engine-readiness-set engine) connection head length framing buffer head-end end))

(defun answer-buffered-request (engine worker connection request-start request-line-end head-end end)
  "Answer the request whose head is in WORKER's buffer, or begin reading its
body.  Returns :KEEP-ALIVE and the end of the next request's octets (moved
to the start of the buffer); :BODY-STARTED, when its body has not all
arrived and has become CONNECTION's ARRIVING-BODY (the buffer is then
empty); :CLOSE; :LET-GO (a handler took the connection over); or
:REFUSE and the status the head is refused with.  The buffer is not an
argument of this frame, which a handler's backtrace shows: it holds other
clients' octets."
  (let* ((buffer (worker-buffer worker))
         (head (handler-case (parse-request-head buffer request-start request-line-end head-end)
                 (request-head-refused (condition)
                   (return-from answer-buffered-request (values :refuse (refused-status condition))))))
         (headers (request-head-headers head))
         (acceptor (engine-acceptor engine))
         (framing nil)
         (framing-refusal nil))
    (cond ((and (assoc :transfer-encoding headers)
                (not (hunchentoot:acceptor-input-chunking-p acceptor)))
           ;; This acceptor takes no chunked body: RFC 9112 6.3 says 411.
           (values :refuse 411))
          ((body-over-limit-p headers (acceptor-max-body-bytes acceptor))
           ;; Refused before a 100 Continue, so the client need not send it.
           (values :refuse 413))
          ((body-still-arriving-p headers head-end end)
           (start-reading-body engine connection head (parse-integer (cdr (assoc :content-length headers))) nil
                               buffer head-end end)
           :body-started)
          ((progn (setf (values framing framing-refusal)
                        (arriving-chunk-framing headers buffer head-end end (acceptor-max-body-bytes acceptor)))
                  framing-refusal)
           ;; Refused before dispatch: a client's mistake costs no handler
           ;; and no backtrace.
           (values :refuse framing-refusal))
          (framing
           (start-reading-body engine connection head nil framing buffer head-end end)
           :body-started)
          (t
           (let ((stream (connection-stream connection))
                 (body-p (request-has-body-p headers)))
             (multiple-value-bind (content-stream buffered chunked-p)
                 (if body-p (content-stream-for headers stream buffer head-end end) stream)
               (multiple-value-bind (outcome status)
                   (answer-parsed-request engine worker connection head content-stream chunked-p
                                          (expects-continue-p head))
                 (if (eq outcome :keep-alive)
                     ;; A chunked body read only in part leaves no way to
                     ;; find where the next request starts.
                     (let ((next-end (and (or (not chunked-p) (body-finished-p content-stream))
                                          (next-request-octets connection buffer body-p buffered head-end end))))
                       (if next-end (values :keep-alive next-end) :close))
                     (values outcome status)))))))))

(defun answer-arrived-body (engine worker connection)
  "Read what has arrived of CONNECTION's ARRIVING-BODY; once it is whole,
answer its request.  Returns :READ-BODY when more is to come; :CLOSE when
the client left; :REFUSE and a status when the body could not be stored
(500) or its chunked framing is refused (400, 413); else what
ANSWER-PARSED-REQUEST returns, with the end of the next request's octets,
moved to the start of WORKER's buffer (read past a chunked body's end)."
  (let* ((set (engine-readiness-set engine))
         (acceptor (engine-acceptor engine))
         (body (connection-arriving-body connection)))
    (multiple-value-bind (state detail)
        (handler-case (receive-body-octets connection body (worker-buffer worker)
                                           (acceptor-body-buffer-bytes acceptor))
          (request-body-not-stored (condition)
            (log-safely acceptor :error "~A" condition)
            (return-from answer-arrived-body (values :refuse 500))))
      (ecase state
        (:would-block :read-body)
        (:closed :close)
        (:refuse (values :refuse detail))
        (:whole
         (let ((chunked-p (and (arriving-body-framing body) t))
               (next-octets (or detail #())))
           (multiple-value-bind (outcome status)
               (unwind-protect
                    (answer-parsed-request engine worker connection (arriving-body-head body)
                                           (if chunked-p
                                               ;; The reply goes through it too.
                                               (make-chunked-body-stream
                                                (make-two-way-stream (arrived-body-stream body)
                                                                     (connection-stream connection))
                                                (acceptor-max-body-bytes acceptor))
                                               (arrived-body-stream body))
                                           chunked-p nil)
                 (discard-arriving-body set connection))
             (if (eq outcome :keep-alive)
                 (progn (replace (worker-buffer worker) next-octets)
                        (values :keep-alive (length next-octets)))
                 (values outcome status)))))))))

(defun answer-arrived-requests (engine worker connection)
  "Send the rest of CONNECTION's last reply, then answer every request it
has sent so far, reading the bodies that follow their heads.  Returns what
is to become of it: :PARK and the end of the partial head at the start of
WORKER's buffer (0 for none); :SEND-REST and the same, when the socket did
not take a reply whole; :READ-BODY, when a request's body is still to
come; :CLOSE; :LET-GO; or :REFUSE and a status.  The octets of the next
request always start the buffer: NEXT-REQUEST-OCTETS moves them there."
  (let* ((buffer (worker-buffer worker))
         (max-header-bytes (acceptor-max-header-bytes (engine-acceptor engine)))
         (end (take-pending-bytes connection buffer)))
    (when (connection-outgoing connection)
      (case (send-outgoing (engine-readiness-set engine) connection)
        (:would-block (return-from answer-arrived-requests (values :send-rest end)))
        (:close (return-from answer-arrived-requests :close))))
    (loop
      (multiple-value-bind (outcome next)
          (if (connection-arriving-body connection)
              (answer-arrived-body engine worker connection)
              (multiple-value-bind (status request-start request-line-end head-end)
                  (scan-request-head buffer 0 end max-header-bytes)
                (case status
                  (:complete
                   (answer-buffered-request engine worker connection request-start request-line-end head-end end))
                  (:incomplete
                   (let ((count (receive-bytes connection buffer end (length buffer))))
                     (cond ((eq count :would-block) (values :park end))
                           ((or (eq count :error) (zerop count)) :close)
                           (t (unless (connection-head-started connection)
                                (setf (connection-head-started connection) (get-internal-real-time)))
                              (incf end count)
                              :more))))
                  (t (values :refuse status)))))
        (case outcome
          (:more)
          (:body-started (setf end 0))
          ((:keep-alive :close :let-go)
           (when (eq outcome :keep-alive)
             (setf (connection-head-started connection) (and (plusp next) (get-internal-real-time))))
           (let ((outgoing (connection-outgoing connection)))
             (when outgoing
               (setf (outgoing-then outgoing) (if (eq outcome :keep-alive) :keep-alive :close))
               (return (values :send-rest (if (eq outcome :keep-alive) next 0)))))
           (unless (eq outcome :keep-alive)
             (return outcome))
           (setf end next)
           (when (zerop end)
             ;; Trying one more read before parking did not pay (bench run
             ;; 2026-11-22T004655Z), so a kept-alive connection parks at once.
             (return (values :park 0))))
          (t (return (values outcome next))))))))

(defun park-until (engine set connection deadline)
  "Park CONNECTION, which the caller holds, until bytes arrive or DEADLINE
passes; close it instead when the pool is stopping or the descriptor cannot
be armed."
  (cond ((stopping-p engine) (close-connection set connection))
        ((park-connection set connection deadline)
         ;; HUNCHENTOOT:STOP sets its flag, then closes what is parked.
         (memory-barrier)
         (when (and (stopping-p engine) (take-parked-connection set connection))
           (close-connection set connection)))
        (t (close-connection set connection))))

(defun park-or-end (engine set connection buffer end)
  "Park CONNECTION with the END octets of BUFFER (the start of a head, or
none) until more arrive; end it instead if its deadline has passed or the
pool is stopping."
  (let* ((now (get-internal-real-time))
         (head-started (connection-head-started connection))
         (deadline (if head-started
                       (+ head-started (readiness-set-header-timeout set))
                       (+ now (readiness-set-keep-alive-timeout set)))))
    (setf (connection-timeout-status connection) (and head-started 408))
    (cond ((stopping-p engine) (close-connection set connection))
          ((<= deadline now) (end-parked-connection set connection))
          (t
           (when (plusp end)
             (setf (connection-pending connection) (subseq buffer 0 end)))
           (park-until engine set connection deadline)))))

(defun park-until-writable (engine set connection buffer end)
  "Park CONNECTION, whose reply its socket did not take whole, until the
socket has room, keeping the END octets of BUFFER (requests the client
sent meanwhile); the client has the write timeout to take more, and again
each time it has taken some (CLIENT-TOOK-OCTETS-P)."
  (when (plusp end)
    (setf (connection-pending connection) (subseq buffer 0 end)))
  (setf (connection-awaiting connection) :output
        (connection-timeout-status connection) nil)
  (note-unacknowledged-octets connection)
  (park-until engine set connection (+ (get-internal-real-time) (readiness-set-write-timeout set))))

(defun park-until-body-arrives (engine set connection)
  "Park CONNECTION, held by the caller, until more of its ARRIVING-BODY
comes; it is answered 408 if nothing does for the read timeout."
  (setf (connection-awaiting connection) :input
        (connection-timeout-status connection) nil)
  (park-until engine set connection (+ (get-internal-real-time) (readiness-set-read-timeout set))))

(defun take-queued-connections (engine set deadline)
  "Accept each connection the kernel has queued on SET's listening socket,
until none is left or DEADLINE (internal real time) passes, and park each
for its first request as a worker would: a soft STOP serves them before
the socket stops listening."
  (loop while (< (get-internal-real-time) deadline)
        do (let ((connection (accept-new-connection engine set)))
             (if connection
                 (park-or-end engine set connection #() 0)
                 (return)))))

(defmethod hunchentoot:process-connection ((acceptor parallel-acceptor) (socket connection-socket))
  "Serve the requests that have arrived on the connection SOCKET stands for,
which the calling worker holds, then park it, close it or let it go.
Called each time a worker takes the connection up, not once for its life:
:AROUND methods run around each such turn, in the worker's thread."
  (let* ((worker *worker*)
         (engine (taskmaster-engine (worker-taskmaster worker)))
         (set (engine-readiness-set engine))
         (connection (connection-socket-connection socket)))
    (with-connection-bindings ()
      (multiple-value-bind (outcome detail) (answer-arrived-requests engine worker connection)
        (when (let-go-of-connection worker)
          (ecase outcome
            (:park (park-or-end engine set connection (worker-buffer worker) detail))
            (:send-rest (park-until-writable engine set connection (worker-buffer worker) detail))
            (:read-body (park-until-body-arrives engine set connection))
            (:close (close-connection set connection))
            (:let-go (remove-connection set connection))
            (:refuse (refuse-and-close set connection detail))))))))
