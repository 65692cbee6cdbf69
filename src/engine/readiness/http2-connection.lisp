;;;; A connection that speaks HTTP/2: its protocol state (an HTTP2-SESSION,
;;;; nghttp2-session.lisp), its outbox of frames (outbox.lisp, "Sending from
;;;; any thread": the holder reading frames and every worker whose handler
;;;; answered one of its streams send through it), and how it waits in the
;;;; readiness set -- for the client's next frames, for room in its socket,
;;;; for its idle deadline.  Its frames are read, and its streams handed to
;;;; workers, by its turn (http2-turn.lisp).
;;;;
;;;; Frames leave in the order libnghttp2 made them: output is taken from
;;;; the session and offered to the outbox under the session's lock
;;;; (TAKE-HTTP2-OUTPUT), and the outbox keeps the order offers came in.
;;;; What waits is bounded by MAX-QUEUE-BYTES: output is taken only while
;;;; less than half of it waits, so a client that reads nothing holds at
;;;; most that, its streams' replies waiting in the session (flow control
;;;; and the data source read as the socket drains).
;;;;
;;;; These functions never close the connection: they say when the caller
;;;; is to (CLOSE-CONNECTION, closing.lisp, ends it).

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (http2-connection (:include outbox) (:constructor %make-http2-connection))
  "What the engine keeps of a connection that speaks HTTP/2."
  ;; The acceptor it was opened on, for its limits and its log.
  (acceptor nil :read-only t)
  (session nil :type http2-session :read-only t)
  ;; The connection's peer and local addresses, for its streams' requests.
  (addresses '() :read-only t)
  ;; Its streams whose handlers are queued or running: the holder adds,
  ;; the workers that ran them subtract.  At most MAX-STREAMS: a stream
  ;; past them is refused, whatever the client reset meanwhile.
  (running 0 :type word)
  (max-streams 0 :type fixnum :read-only t)
  ;; Of those, the ones queued and not begun; and true while a flush of
  ;; what the others answered is deferred (FINISH-HTTP2-HANDLER).
  (queued 0 :type word)
  (flush-pending-p nil)
  ;; Internal time units: idle with no stream open, then with streams
  ;; open whose requests do not arrive.
  (keep-alive-timeout 0 :type fixnum :read-only t)
  (read-timeout 0 :type fixnum :read-only t)
  ;; Internal real time the client last sent octets or a stream was
  ;; answered.
  (last-active (get-internal-real-time) :type fixnum)
  ;; Why its GOAWAY is to be sent when it closes (*HTTP2-GOAWAY-CAUSES*),
  ;; or NIL; T once sent.
  (goaway nil))

(defmethod print-object ((connection http2-connection) stream)
  (print-unreadable-object (connection stream :type t :identity t)
    (format stream "~S, ~D running" (http2-connection-state connection) (http2-connection-running connection))))

(defun make-http2-connection (set connection acceptor addresses)
  "Make CONNECTION, held by the caller in SET, speak HTTP/2 with ACCEPTOR's
limits, counted open; returns its HTTP2-CONNECTION, whose SETTINGS wait
to be sent."
  (let ((budget (readiness-set-memory-budget set)))
    (atomic-increment (readiness-set-http2-count set))
    (atomic-increment (connection-counters-http2-connections (readiness-set-counters set)))
    (setf (connection-http2 connection)
          (%make-http2-connection
           :connection connection :set set :acceptor acceptor :addresses addresses
           :session (make-http2-session :max-concurrent-streams (acceptor-http2-max-concurrent-streams acceptor)
                                        :max-header-bytes (acceptor-max-header-bytes acceptor)
                                        :max-body-bytes (acceptor-max-body-bytes acceptor)
                                        :budget budget :counters (readiness-set-counters set))
           :max-queue-bytes (acceptor-max-websocket-queue-bytes acceptor)
           :max-streams (acceptor-http2-max-concurrent-streams acceptor)
           :keep-alive-timeout (readiness-set-keep-alive-timeout set)
           :read-timeout (readiness-set-read-timeout set)))))

(defun offer-http2-output (connection)
  "Move the frames CONNECTION's session has made to its outbox, from any
thread, while less than half its MAX-QUEUE-BYTES waits; counted against
the memory budget.  True when some were moved."
  (let ((room (- (floor (http2-connection-max-queue-bytes connection) 2)
                 (http2-connection-unsent-octets connection)))
        (budget (readiness-set-memory-budget (http2-connection-set connection))))
    (when (plusp room)
      (take-http2-output (http2-connection-session connection) room
                         (lambda (octets)
                           (let ((counted (charged-octets octets budget)))
                             (offer-outbox-octets connection counted)
                             (let-go-of-counted-octets counted)))))))

(defun http2-deadline (connection)
  "When CONNECTION, about to park, is next looked at without its client:
the write timeout while frames wait; none while its handlers run; else
the read timeout from its last activity while streams are open, the
keep-alive timeout when none is."
  (let ((now (get-internal-real-time)))
    (cond ((http2-connection-queue connection) (outbox-write-deadline connection now))
          ((plusp (http2-connection-running connection)) most-positive-fixnum)
          ((plusp (http2-session-open-stream-count (http2-connection-session connection)))
           (+ (http2-connection-last-active connection) (http2-connection-read-timeout connection)))
          (t (+ (http2-connection-last-active connection) (http2-connection-keep-alive-timeout connection))))))

(defun send-http2-frames (connection)
  "Send what waits for CONNECTION, held by the caller, and what its
session makes meanwhile, as far as the socket takes it: :SENT, :WOULD-BLOCK
or :FAILED."
  (loop
    (let ((status (send-outbox-queue connection)))
      (unless (and (eq status :sent) (offer-http2-output connection))
        (return status)))))

(defun park-http2-connection (connection)
  "Send what CONNECTION has to send, then park it, held by the caller,
until its client sends, its socket has room, or its deadline
(HTTP2-DEADLINE).  T when parked (and perhaps another thread's already);
:CLOSE when the caller is to close it: a send to it was refused, its
client has gone, its session has ended with nothing left to send, or the
descriptor could not be armed."
  (let ((holder (http2-connection-connection connection))
        (set (http2-connection-set connection)))
    (loop
      (when (or (http2-connection-refusal-code connection)
                (eq (send-http2-frames connection) :failed))
        (return :close))
      (when (and (null (http2-connection-queue connection))
                 (not (http2-session-active-p (http2-connection-session connection))))
        (return :close))
      (setf (connection-awaiting holder) (if (http2-connection-queue connection) :output :input)
            (connection-timeout-status holder) nil)
      (unless (park-connection set holder (http2-deadline connection))
        (return :close))
      ;; See "Sending from any thread" in outbox.lisp.
      (memory-barrier)
      (unless (and (or (http2-connection-inbox connection) (http2-connection-refusal-code connection))
                   (take-parked-connection holder))
        (return t)))))

(defun send-http2-goaway (connection cause)
  "Queue CONNECTION's GOAWAY for CAUSE, counted, unless sent already."
  (unless (eq (http2-connection-goaway connection) t)
    (setf (http2-connection-goaway connection) t)
    (count-http2-goaway (readiness-set-counters (http2-connection-set connection)) cause)
    (submit-http2-goaway (http2-connection-session connection))
    (offer-http2-output connection)))

(defun http2-deadline-reached (connection)
  "CONNECTION's socket, held by the caller, was parked until a deadline
that has passed: parked again while its handlers run or its client takes
what is sent; else :CLOSE, after a GOAWAY when it was idle or its streams
stalled, counted as a write timeout when its client took nothing."
  (let ((holder (http2-connection-connection connection))
        (counters (readiness-set-counters (http2-connection-set connection))))
    (cond ((http2-connection-queue connection)
           (if (client-took-octets-p holder)
               (park-http2-connection connection)
               (progn (atomic-increment (connection-counters-write-timeouts counters))
                      :close)))
          ((plusp (http2-connection-running connection)) (park-http2-connection connection))
          (t (atomic-increment (connection-counters-keep-alive-timeouts counters))
             (setf (http2-connection-goaway connection) (or (http2-connection-goaway connection) :idle))
             :close))))

(defun end-http2-connection (connection)
  "CONNECTION's socket, held by the caller, is being closed: its GOAWAY
sent when one is due, with what the socket takes of what waits; its
session freed, its queue dropped, counted closed."
  (unless (eq (http2-connection-state connection) :closed)
    (let ((cause (http2-connection-goaway connection))
          (set (http2-connection-set connection)))
      ;; A cause, not T (sent already) or NIL (none due).
      (when (keywordp cause)
        (send-http2-goaway connection cause)
        (when (eq (send-outbox-queue connection) :sent)
          (linger-before-close (http2-connection-connection connection))))
      (setf (http2-connection-state connection) :closed)
      (drop-outbox-queue connection)
      (free-http2-session (http2-connection-session connection))
      (atomic-decrement (readiness-set-http2-count set)))))
