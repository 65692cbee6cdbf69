;;;; The readiness set's face to the turns that serve its connections
;;;; (engine/serving/), as engine/protocol.lisp is the engine's face to the
;;;; pool: every operation a worker's turn may perform on a connection it
;;;; holds.  serving/ uses the names listed here and no other name defined
;;;; under readiness/ (test house.serving-uses-only-the-readiness-face).
;;;;
;;;; A turn.  A worker that takes a connection from the set holds it
;;;; (connection.lisp, Ownership), starts its stream if it has none
;;;; (START-CONNECTION-SOCKET), reads what arrived, answers, and ends the
;;;; turn with an outcome; after letting go of it in the pool, it hands the
;;;; outcome to END-TURN, which parks, closes or lets go of the connection.
;;;; A turn never arms a descriptor, sets a deadline or parks by itself:
;;;; the edge invariant (a parked connection with unread octets is armed
;;;; again, readiness-set.lisp) and every deadline are readiness's.  What a
;;;; turn must say for them to hold, it says through the NOTE- functions.
;;;;
;;;; Outcomes of a turn, with their detail (END-TURN):
;;;;
;;;;   :PARK end        Wait for more of a head, END octets of it starting the
;;;;                    buffer (0: none), under the header timeout (or, with
;;;;                    no head begun, the keep-alive timeout).
;;;;   :READ-BODY       Wait for more of the ARRIVING-BODY, under the read
;;;;                    timeout.
;;;;   :SEND-REST end   Wait for room for the rest of a reply, under the
;;;;                    write timeout, keeping the END octets the client sent
;;;;                    meanwhile.
;;;;   :WEBSOCKET end   Park the websocket (PARK-WEBSOCKET), END octets of a
;;;;                    frame head that arrived in part starting the buffer.
;;;;   :DEFER end       Wait for the deferred reply (CONNECTION-DEFERRED) to be
;;;;                    completed, keeping the END octets the client sent
;;;;                    after its request, until its timeout.
;;;;   :EVENT-STREAM    Park the event stream the reply became (PARK-EVENT-STREAM).
;;;;   :HTTP2           Park the connection speaking HTTP/2 (PARK-HTTP2-CONNECTION).
;;;;   :HANDSHAKE for   Wait until the socket is ready FOR (:INPUT, :OUTPUT)
;;;;                    the TLS handshake, under the header timeout.
;;;;   :CLOSE           Close it.
;;;;   :LET-GO          Forget it: a handler took it over (DETACH-SOCKET).
;;;;   :REFUSE status   Answer the error reply of STATUS and close it;
;;;;                    :MEMORY is 503 for a memory budget past its limit,
;;;;                    :NOT-HTTP 400 for a request line naming no HTTP
;;;;                    version (REFUSE-LINE-NAMING-NO-HTTP).
;;;;
;;;; The face, by what a turn does (the functions' docstrings are the
;;;; contracts; those not defined below say in which file):
;;;;
;;;;   Start and end      START-CONNECTION-SOCKET, which makes the
;;;;                      CONNECTION-SOCKET (connection-socket.lisp) that
;;;;                      PROCESS-CONNECTION is called with;
;;;;                      HELD-CONNECTION-KIND, whose turn it is; END-TURN.
;;;;   Read               TAKE-PENDING-BYTES, RECEIVE-BYTES (arrived-octets.lisp):
;;;;                      the octets kept while parked, then the socket's;
;;;;                      READ-ARRIVED-OCTETS (arrived-octets.lisp) what a
;;;;                      stream read ahead; CONNECTION-STREAM,
;;;;                      PLAIN-CONNECTION-P, CONNECTION-ADDRESSES
;;;;                      (connection.lisp).
;;;;   Bodies             START-ARRIVING-BODY, RECEIVE-ARRIVING-BODY,
;;;;                      DISCARD-ARRIVING-BODY (arriving-body.lisp),
;;;;                      CONNECTION-ARRIVING-BODY (connection.lisp).
;;;;   Reply              SEND-REPLY-WITHOUT-WAITING, WRITE-REPLY-BODY
;;;;                      (outgoing.lisp); SEND-REST-OF-REPLY,
;;;;                      FOLLOW-REPLY-REST-WITH.  BATCH-REPLY in its
;;;;                      place keeps a whole reply in the worker's batch,
;;;;                      sent with the others before the worker waits
;;;;                      again; a turn that goes on to another request
;;;;                      sends it first, SEND-BATCHED-REPLY (reply-batch.lisp).
;;;;   Note               NOTE-HEAD-OCTETS, NOTE-INPUT-READ-BY-STREAM,
;;;;                      NOTE-ANSWERED-REQUEST; MEMORY-BUDGET-EXCEEDED-P
;;;;                      (memory-budget.lisp) before new work.
;;;;   Held replies       SETTLE-DEFERRED-REPLY, the turn of a reply
;;;;                      DEFER-REPLY made; EVENT-STREAM-TURN, that of an
;;;;                      event stream START-EVENT-STREAM made;
;;;;                      ABANDON-HELD-REPLY when the handler that made
;;;;                      either failed.
;;;;   Websocket          MAKE-WEBSOCKET (websocket-connection.lisp),
;;;;                      CONNECTION-WEBSOCKET, and its WEBSOCKET-READER: the
;;;;                      turns' own frame reader, opaque here;
;;;;                      WEBSOCKET-OPEN-P, NOTE-WEBSOCKET-INPUT,
;;;;                      NOTE-WEBSOCKET-PING (websocket-connection.lisp),
;;;;                      BEGIN-WEBSOCKET-MESSAGE, KEEP-MESSAGE-OCTETS,
;;;;                      WEBSOCKET-MESSAGE-LENGTH (websocket-connection.lisp),
;;;;                      END-WEBSOCKET-MESSAGE, RESERVE-MESSAGE-MEMORY and
;;;;                      RELEASE-MESSAGE-MEMORY for a message inflated,
;;;;                      NOTE-WEBSOCKET-MESSAGE,
;;;;                      CALL-RESOURCE, FAIL-WEBSOCKET,
;;;;                      CLIENT-READS-SLOWER-THAN-IT-SENDS-P.
;;;;   HTTP/2             CONNECTION-HTTP2-STATE, whether a connection is to
;;;;                      speak it; HTTP2-TURN, which reads its frames and
;;;;                      calls back for each stream's request in a worker
;;;;                      (http2-turn.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

;;; Start and end.

(defun start-connection-socket (engine connection)
  "The CONNECTION-SOCKET that HUNCHENTOOT:PROCESS-CONNECTION is called with
for CONNECTION, held by the caller, its stream started first when it has
none (START-CONNECTION-STREAM).  Else :INPUT or :OUTPUT while its TLS
handshake waits for the socket (the turn ends :HANDSHAKE with it), or NIL
when the client has gone, the handshake failed or the pool is stopping
(the turn ends :CLOSE)."
  (or (connection-usocket connection)
      (let ((started (start-connection-stream engine connection)))
        (if (eq started t) (connection-usocket connection) started))))

(defun held-connection-kind (connection)
  "What CONNECTION, held by the caller, has become, which says what its turn
is: :WEBSOCKET, :HTTP2, :DEFERRED (its reply waits to be completed),
:EVENT-STREAM, or NIL (the request cycle)."
  (cond ((connection-websocket connection) :websocket)
        ((connection-http2 connection) :http2)
        ((connection-deferred connection) :deferred)
        ((connection-event-stream connection) :event-stream)))

(defun end-turn (set connection buffer outcome detail)
  "Act on the OUTCOME of a turn on CONNECTION, with its DETAIL (see the
outcomes above), the caller having held the connection in SET and let go
of it in the pool; BUFFER is the worker's, whose first octets a parked
connection keeps."
  (when (connection-batch connection)
    ;; Its last reply waits in its worker's batch (reply-batch.lisp).  The
    ;; request cycle ends a turn :PARK 0 or :CLOSE after it; any other
    ;; outcome sends it first, so that it never goes after what follows.
    (when (or (eq outcome :close) (and (eq outcome :park) (eql detail 0)))
      (return-from end-turn (end-turn-on-batched-reply connection outcome)))
    (if (send-batched-reply connection)
        (when (and (eq outcome :park) (follow-reply-rest-with connection :keep-alive))
          (setf outcome :send-rest))
        (setf outcome :close)))
  (ecase outcome
    (:park (park-or-end set connection buffer detail))
    (:read-body (park-until-body-arrives set connection))
    (:send-rest (park-until-writable set connection buffer detail))
    ((:websocket :event-stream :http2)
     (if (stopping-p set)
         (close-connection set connection)
         (progn (keep-pending-bytes connection buffer (or detail 0) (readiness-set-memory-budget set))
                (park-outbox-or-close set connection))))
    (:defer (park-deferred-reply set connection buffer detail))
    (:handshake (park-during-handshake set connection detail))
    (:close (close-connection set connection))
    (:let-go (remove-connection set connection))
    (:refuse (case detail
               (:memory (refuse-for-memory set connection))
               (:not-http (refuse-line-naming-no-http set connection))
               (t (refuse-and-close set connection detail))))))

;;; Deferred reply.

(defun park-deferred-reply (set connection buffer end)
  "Park CONNECTION, held by the caller, its reply deferred, keeping the END
octets of BUFFER, until its client sends or hangs up, or its deadline; taken back and
parked for output when the reply was completed meanwhile (deferred-reply.lisp,
Who arms it)."
  (let ((deferred (connection-deferred connection)))
    (keep-pending-bytes connection buffer end (readiness-set-memory-budget set))
    ;; Watched for input as it was, edge-triggered: no system call; a
    ;; report is its client leaving or sending its next request.
    (setf (connection-awaiting connection) (if (deferred-reply-input-seen-p deferred) :none :input)
          (connection-timeout-status connection) nil)
    (park-until set connection (deferred-reply-deadline deferred))
    (memory-barrier)
    (when (and (completion-p (deferred-reply-outcome deferred))
               (take-parked-connection connection)
               (not (park-for-completed-reply set connection)))
      (close-connection set connection))))

(defun settle-deferred-reply (set connection)
  "What CONNECTION's deferred reply is to the turn of the worker holding it:
:COMPLETED, the reply detached from the connection, then the request, the
reply and the session of its handler, the status, headers and body it was
completed with, and the MONOTONIC-MICROSECONDS it was deferred at; :GONE when the client reset the connection (then told
to its ON-CLIENT-GONE) or the reply was settled otherwise (the turn ends
:CLOSE); :WAITING when the report was stale, or was the client's next
request arriving (the turn ends :DEFER 0)."
  (let* ((deferred (connection-deferred connection))
         (outcome (deferred-reply-outcome deferred)))
    (cond ((completion-p outcome)
           (detach-deferred-reply set connection)
           ;; Parked for output to be woken, it parks for input from now on.
           (setf (connection-awaiting connection) :input)
           (values :completed (deferred-reply-request deferred) (deferred-reply-reply deferred)
                   (deferred-reply-session deferred) (completion-status outcome) (completion-headers outcome)
                   (completion-body outcome) (deferred-reply-deferred-at deferred)))
          (outcome :gone)
          (t (case (client-hung-up-p connection)
               ((nil) :waiting)
               ((:input :half-closed) (setf (deferred-reply-input-seen-p deferred) t)
                :waiting)
               (t (if (settle-deferred-reply-outcome deferred :gone)
                      (progn (note-client-gone set deferred)
                             :gone)
                      (settle-deferred-reply set connection))))))))

(defun note-client-gone (set deferred)
  "DEFERRED's client reset the connection before its reply: counted, and told to its
ON-CLIENT-GONE, called with DEFERRED and Hunchentoot's specials bound as in
its handler; an error escaping it is logged."
  (atomic-increment (connection-counters-deferred-clients-gone (readiness-set-counters set)))
  (let ((function (deferred-reply-on-client-gone deferred))
        (acceptor (deferred-reply-acceptor deferred)))
    (when function
      (let ((hunchentoot:*acceptor* acceptor)
            (hunchentoot:*request* (deferred-reply-request deferred))
            (hunchentoot:*session* (deferred-reply-session deferred)))
        (handler-case (funcall function deferred)
          (error (condition)
            (log-safely acceptor :error "Error in the ON-CLIENT-GONE of a deferred reply: ~A" condition)))))))

(defun abandon-held-reply (set connection &optional held)
  "The handler that deferred CONNECTION's reply, or made it an event
stream, failed afterwards: the reply is answered as the failure says, and
the record, detached, can no longer be completed or sent to.  With no
CONNECTION, the handler was an HTTP/2 stream's, which made HELD, its
DEFERRED-REPLY or HTTP2-EVENT-STREAM."
  (cond ((http2-event-stream-p held)
         (end-http2-event-stream held))
        ((null connection)
         (when (settle-deferred-reply-outcome held :abandoned)
           (ended-http2-deferred-reply held)))
        ((connection-deferred connection)
         (settle-deferred-reply-outcome (connection-deferred connection) :abandoned)
         (detach-deferred-reply set connection))
        ((connection-event-stream connection)
         (end-event-stream set (shiftf (connection-event-stream connection) nil)))))

;;; Event stream.

(defun event-stream-turn (connection)
  "The turn of CONNECTION, an event stream, reported ready: :CLOSE when its
client reset it, else :EVENT-STREAM (parked again, sending what waits, to
a client that shut down its side too)."
  (let ((stream (connection-event-stream connection)))
    (case (client-hung-up-p connection)
      ((nil) :event-stream)
      (:input (setf (event-stream-input-seen-p stream) t)
       :event-stream)
      (:half-closed
       (unless (event-stream-input-seen-p stream)
         ;; A comment sent at once: a client gone, not only half-closed,
         ;; answers it with a reset, which ends the stream now rather than
         ;; at its next event.
         (setf (event-stream-input-seen-p stream) t)
         (queue-keep-alive-comment stream))
       :event-stream)
      (t :close))))

;;; Reply.

(defun send-rest-of-reply (set connection)
  "Send more of the rest of CONNECTION's last reply that its socket did not
take, if there is one (NIL when not): what follows once it has all gone
(:KEEP-ALIVE or :CLOSE), :WOULD-BLOCK when the socket is full again, or
:CLOSE when the client has gone."
  (when (connection-outgoing connection)
    (send-outgoing set connection)))

(defun follow-reply-rest-with (connection then)
  "When the socket did not take CONNECTION's reply whole, make THEN
(:KEEP-ALIVE or :CLOSE) follow its rest, and return true; else NIL."
  (let ((outgoing (connection-outgoing connection)))
    (when outgoing
      (setf (outgoing-then outgoing) then)
      t)))

;;; Note.

(defun note-head-octets (connection)
  "Octets of CONNECTION's next head have arrived: its header timeout runs
from now, unless it runs already."
  (unless (connection-head-started connection)
    (setf (connection-head-started connection) (get-internal-real-time))))

(defun note-input-read-by-stream (connection)
  "A stream reads CONNECTION's input (a chunked body): octets may wait on
its socket that no new edge will report, and the connection is armed again
when it parks."
  (setf (connection-unread-p connection) t))

(defun note-answered-request (set connection stripe status microseconds)
  "CONNECTION's request was answered STATUS in MICROSECONDS: counted in
STRIPE of SET's counters; a soft STOP no longer waits for the connection
(ENGINE-DRAIN); the next head's header timeout runs from its first octets
(NOTE-HEAD-OCTETS)."
  (setf (connection-answered-p connection) t
        (connection-head-started connection) nil)
  (count-answered-request (readiness-set-counters set) stripe status microseconds))

;;; Websocket.

(defun websocket-open-p (websocket)
  "True while WEBSOCKET neither sent its close frame nor ended."
  (eq (websocket-state websocket) :open))

(defun fail-websocket (websocket code reason)
  "Make WEBSOCKET close with CODE and REASON (RFC 6455 7.1.7): returns the
turn's outcome, :CLOSE."
  (setf (websocket-close-code websocket) code
        (websocket-close-reason websocket) reason)
  :close)

(defun note-websocket-input (websocket count)
  "COUNT octets came from WEBSOCKET's client: it has been heard now, and
need not be pinged before the ping interval from now."
  (atomic-add (connection-counters-websocket-octets-in (websocket-counters websocket)) count)
  (setf (websocket-last-heard websocket) (get-internal-real-time)
        (websocket-pinged-p websocket) nil))

(defun begin-websocket-message (websocket)
  "The first frame of a message from WEBSOCKET's client has begun: the
message timeout runs from now."
  (setf (websocket-message-started websocket) (get-internal-real-time)))

(defun keep-message-octets (websocket buffer start end frame-rest room)
  "Keep the octets of BUFFER from START below END, FRAME-REST octets of
their frame being left from START on, with WEBSOCKET's message, which may
take ROOM octets more.  False when the memory budget had no room for them."
  (add-message-octets (or (websocket-message websocket)
                          (setf (websocket-message websocket) (make-arriving-message)))
                      (readiness-set-memory-budget (websocket-set websocket))
                      buffer start end frame-rest room))

(defun end-websocket-message (websocket)
  "The message from WEBSOCKET's client has ended: its octets kept by
KEEP-MESSAGE-OCTETS in one vector, or NIL when none were; the memory they
took is given back and the message timeout stops."
  (let ((message (websocket-message websocket)))
    (setf (websocket-message-started websocket) nil)
    (when message
      (prog1 (message-octets message)
        (drop-websocket-message websocket)))))

(defun reserve-message-memory (websocket octets)
  "Take OCTETS from the memory budget for a buffer WEBSOCKET's message is
inflated into, as a client's input.  True when they fit; give them back
with RELEASE-MESSAGE-MEMORY."
  (reserve-memory (readiness-set-memory-budget (websocket-set websocket)) octets :input-p t))

(defun release-message-memory (websocket octets)
  (release-memory (readiness-set-memory-budget (websocket-set websocket)) octets))

(defun note-websocket-message (websocket)
  "A whole message came from WEBSOCKET's client: counted.  True when the
websocket is open, so that it is handed to the resource."
  (atomic-increment (connection-counters-websocket-messages-in (websocket-counters websocket)))
  (websocket-open-p websocket))

(defun call-resource (websocket function &rest arguments)
  "Call FUNCTION, the name of one of the resource generic functions, on
WEBSOCKET's resource, its client and ARGUMENTS, with Hunchentoot's specials
bound as in the request that opened WEBSOCKET.  True when it returned; when
an error escaped it, the error is logged, WEBSOCKET is to close with 1011,
and NIL is returned."
  (let* ((resource (websocket-resource websocket))
         (client (websocket-client websocket))
         (request (ws:client-request client))
         (hunchentoot:*acceptor* (websocket-acceptor websocket))
         (hunchentoot:*request* request)
         (hunchentoot:*session* (hunchentoot:session request)))
    (handler-case (progn (apply function resource client arguments) t)
      (error (condition)
        (log-safely (websocket-acceptor websocket) :error "Error in ~(~A~) of ~A: ~A"
                    function resource condition)
        (fail-websocket websocket 1011 "Internal error")
        nil))))

(defun client-reads-slower-than-it-sends-p (websocket)
  "Send the pongs and what the client's own messages made for it (its
messages echoed or broadcast back) as far as its socket takes them now;
true when half its queue's limit still waits, so that the turn reads no
more of what it sent until it has taken that: a client that sends faster
than it reads is slowed, not closed for the answers to its own messages."
  ;; The pongs first, as at the end of a turn (PARK-WEBSOCKET).
  (queue-websocket-pongs websocket)
  (when (or (websocket-inbox websocket) (websocket-queue websocket))
    (send-websocket-queue websocket))
  (> (websocket-unsent-octets websocket) (floor (websocket-max-queue-bytes websocket) 2)))
