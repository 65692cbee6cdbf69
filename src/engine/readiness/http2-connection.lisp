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
;;;; What waits is bounded by MAX-QUEUE-BYTES: output is taken, under that
;;;; lock, only while less than half of it waits, one frame passing it at
;;;; most, so an offer always finds room; a client that reads nothing holds
;;;; at most that, its streams' replies waiting in the session (flow control
;;;; and the data source read as the socket drains).
;;;;
;;;; Its streams wait their turn.  A stream whose request is whole waits in
;;;; WAITING, without a worker, until fewer than MAX-RUNNING of the
;;;; connection's handlers run, and what its replies hold for the client,
;;;; with what those running will make at the REPLY-SIZE its replies have
;;;; had, is below its BUDGET-SHARE (TAKE-STARTABLE-STREAMS, asked whenever
;;;; one of them may have changed); so that one client can take neither the
;;;; pool nor the memory budget, nor make replies faster than it reads
;;;; them.  WAITING is kept under the session's lock, and RUNNING and
;;;; QUEUED grow under it too; they shrink, atomic words, without it, as a
;;;; handler begins and ends, when REPLY-SIZE, an estimate, is written
;;;; whole by whichever thread.
;;;;
;;;; These functions never close the connection: they say when the caller
;;;; is to (CLOSE-CONNECTION, closing.lisp, ends it).

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *http2-preface* (map 'octets #'char-code (format nil "PRI * HTTP/2.0~C~C~C~CSM~C~C~C~C"
                                                             #\Return #\Linefeed #\Return #\Linefeed
                                                             #\Return #\Linefeed #\Return #\Linefeed))
  "What an HTTP/2 client sends first (RFC 9113 3.4).")

(defconstant +http2-connections-sharing-budget+ 32
  "An HTTP/2 connection's streams may hold a 1/32 of the memory budget in
replies before no more of them begin.")

(defconstant +http2-least-budget-share+ (* 1024 1024)
  "The octets an HTTP/2 connection's streams may hold in replies however
small the budget.")

(defstruct (http2-connection (:include outbox) (:constructor %make-http2-connection))
  "What the engine keeps of a connection that speaks HTTP/2."
  ;; The acceptor it was opened on, for its limits and its log.
  (acceptor nil :read-only t)
  (session nil :type http2-session :read-only t)
  ;; The connection's peer and local addresses, for its streams' requests.
  (addresses '() :read-only t)
  ;; Its streams whose handlers are queued or running, and those waiting
  ;; to be: at most MAX-STREAMS together, a stream past them is refused,
  ;; whatever the client reset meanwhile.  WAITING is oldest first, with
  ;; its last cons.
  (running 0 :type word)
  (waiting '())
  (waiting-tail '())
  (max-streams 0 :type fixnum :read-only t)
  ;; The most of its handlers that run at once, and the octets its
  ;; streams' replies may hold before no more of its streams begin.
  (max-running 0 :type fixnum :read-only t)
  (budget-share 0 :type fixnum :read-only t)
  ;; The octets a reply of its streams is expected to take: a moving
  ;; average of those made, from a quarter of BUDGET-SHARE (so that four
  ;; begin at first, until the replies tell).
  (reply-size 0 :type fixnum)
  ;; Of the running, the ones queued and not begun; and true while a flush
  ;; of what the others answered is deferred (FINISH-HTTP2-HANDLER).
  (queued 0 :type word)
  (flush-pending-p nil)
  ;; Its streams whose reply their handler deferred, waiting for it
  ;; without a worker (MAKE-HTTP2-DEFERRED-REPLY), which a soft STOP waits
  ;; for; and those that are event streams (MAKE-HTTP2-EVENT-STREAM),
  ;; which it ends.
  (held 0 :type word)
  (streaming 0 :type word)
  ;; Internal time units: idle with no stream open, then with streams
  ;; open whose requests do not arrive.
  (keep-alive-timeout 0 :type fixnum :read-only t)
  (read-timeout 0 :type fixnum :read-only t)
  ;; Internal real time the client last sent octets or a stream was
  ;; answered.
  (last-active (get-internal-real-time) :type fixnum)
  ;; Why its GOAWAY is to be sent when it closes (*HTTP2-GOAWAY-CAUSES*),
  ;; or NIL; T once sent.
  (goaway nil)
  ;; Called with the connection, from any thread, when streams of WAITING
  ;; may begin: queues a worker's task for each (http2-turn.lisp).
  (start-streams nil :type function :read-only t))

(defmethod print-object ((connection http2-connection) stream)
  (print-unreadable-object (connection stream :type t :identity t)
    (format stream "~S, ~D running" (http2-connection-state connection) (http2-connection-running connection))))

(defun make-http2-connection (set connection acceptor addresses start-streams)
  "Make CONNECTION, held by the caller in SET, speak HTTP/2 with ACCEPTOR's
limits, counted open, its waiting streams begun by START-STREAMS; returns
its HTTP2-CONNECTION, whose SETTINGS wait to be sent."
  (let ((budget (readiness-set-memory-budget set)))
    (atomic-increment (readiness-set-http2-count set))
    (atomic-increment (connection-counters-http2-connections (readiness-set-counters set)))
    (setf (connection-http2 connection)
          (%make-http2-connection
           :connection connection :set set :acceptor acceptor :addresses addresses :start-streams start-streams
           :session (make-http2-session :max-concurrent-streams (acceptor-http2-max-concurrent-streams acceptor)
                                        :max-header-bytes (acceptor-max-header-bytes acceptor)
                                        :max-body-bytes (acceptor-max-body-bytes acceptor)
                                        :budget budget :counters (readiness-set-counters set))
           :max-queue-bytes (acceptor-max-websocket-queue-bytes acceptor)
           :max-streams (acceptor-http2-max-concurrent-streams acceptor)
           :max-running (acceptor-http2-max-running-streams acceptor)
           :budget-share (http2-budget-share budget)
           :reply-size (floor (http2-budget-share budget) 4)
           :keep-alive-timeout (readiness-set-keep-alive-timeout set)
           :read-timeout (readiness-set-read-timeout set)))))

(defun http2-budget-share (budget)
  "The octets the streams of one HTTP/2 connection may hold in replies."
  (max +http2-least-budget-share+ (floor (memory-budget-limit budget) +http2-connections-sharing-budget+)))

(defun offer-http2-output (connection)
  "Move the frames CONNECTION's session has made to its outbox, from any
thread, while less than half its MAX-QUEUE-BYTES waits, asked under the
session's lock; counted against the memory budget.  True when some were
moved."
  (let ((budget (readiness-set-memory-budget (http2-connection-set connection))))
    (take-http2-output (http2-connection-session connection)
                       (lambda () (- (floor (http2-connection-max-queue-bytes connection) 2)
                                     (http2-connection-unsent-octets connection)))
                       (lambda (octets)
                         ;; Never refused for want of room, taken under the
                         ;; lock; dropped when the connection has ended.
                         (let ((counted (charged-octets octets budget)))
                           (offer-outbox-octets connection counted)
                           (let-go-of-counted-octets counted))))))

(defun http2-connection-reply-octets (connection)
  "The octets CONNECTION's streams' replies hold for its client: taken by
the library and waiting in its outbox, or not taken yet."
  (+ (http2-connection-unsent-octets connection)
     (http2-session-reply-octets (http2-connection-session connection))))

(defun add-waiting-stream (connection stream)
  "Add STREAM, whole, to CONNECTION's WAITING, under the session's lock:
false, nothing added, when MAX-STREAMS run or wait already."
  (bt:with-lock-held ((http2-session-lock (http2-connection-session connection)))
    (when (< (+ (http2-connection-running connection) (length (http2-connection-waiting connection)))
             (http2-connection-max-streams connection))
      (let ((cell (list stream)))
        (if (http2-connection-waiting connection)
            (setf (cdr (http2-connection-waiting-tail connection)) cell)
            (setf (http2-connection-waiting connection) cell))
        (setf (http2-connection-waiting-tail connection) cell))
      t)))

(defun take-startable-streams (connection)
  "The streams of CONNECTION's WAITING that may begin now, oldest first,
taken from it and counted running and queued: while fewer than MAX-RUNNING
of its handlers run, and its replies hold less than BUDGET-SHARE, and will
with one of REPLY-SIZE for each handler running and the next (but for the
first, when none runs)."
  (when (http2-connection-waiting connection)
    (bt:with-lock-held ((http2-session-lock (http2-connection-session connection)))
      (loop while (and (http2-connection-waiting connection)
                       (< (http2-connection-running connection) (http2-connection-max-running connection))
                       (< (http2-connection-reply-octets connection) (http2-connection-budget-share connection))
                       (or (zerop (http2-connection-running connection))
                           (< (+ (http2-connection-reply-octets connection)
                                 (* (1+ (http2-connection-running connection)) (http2-connection-reply-size connection)))
                              (http2-connection-budget-share connection))))
            do (atomic-increment (http2-connection-running connection))
               (atomic-increment (http2-connection-queued connection))
            collect (pop (http2-connection-waiting connection))))))

(defun note-http2-reply-size (connection octets)
  "A reply of OCTETS was made on CONNECTION: its REPLY-SIZE moves a
quarter of the way to it."
  (incf (http2-connection-reply-size connection)
        (floor (- octets (http2-connection-reply-size connection)) 4)))

(defun http2-connection-busy-p (connection)
  "True while CONNECTION's handlers run, or its deferred replies or event
streams wait: each has its own bound, and its client need not send."
  (or (plusp (http2-connection-running connection))
      (plusp (http2-connection-held connection))
      (plusp (http2-connection-streaming connection))))

(defun http2-deadline (connection)
  "When CONNECTION, about to park, is next looked at without its client:
the write timeout while frames wait; none while it is busy
(HTTP2-CONNECTION-BUSY-P); else
the read timeout from its last activity while streams are open, the
keep-alive timeout when none is."
  (let ((now (get-internal-real-time)))
    (cond ((http2-connection-queue connection) (outbox-write-deadline connection now))
          ((http2-connection-busy-p connection) most-positive-fixnum)
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
      ;; What was sent may have made room for waiting streams.
      (when (http2-connection-waiting connection)
        (funcall (http2-connection-start-streams connection) connection))
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
that has passed: parked again while it is busy (HTTP2-CONNECTION-BUSY-P)
or its client takes what is sent; else :CLOSE after a GOAWAY (which a full socket may not
take): counted as a write timeout when its client took nothing of what
waits, or let its replies wait on flow control; as idle when it was."
  (let ((holder (http2-connection-connection connection))
        (counters (readiness-set-counters (http2-connection-set connection))))
    (flet ((close-for (cause)
             (if (eq cause :slow-reader)
                 (atomic-increment (connection-counters-write-timeouts counters))
                 (atomic-increment (connection-counters-keep-alive-timeouts counters)))
             (setf (http2-connection-goaway connection) (or (http2-connection-goaway connection) cause))
             :close))
      (cond ((http2-connection-queue connection)
             (if (client-took-octets-p holder)
                 (park-http2-connection connection)
                 (close-for :slow-reader)))
            ((http2-connection-busy-p connection) (park-http2-connection connection))
            ((plusp (http2-connection-reply-octets connection)) (close-for :slow-reader))
            (t (close-for :idle))))))

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

;;; Replies the engine makes itself.

(defun refuse-http2-stream-with (set session stream status &optional explanation)
  "Answer STREAM the engine's error reply for STATUS, without a handler."
  (multiple-value-call #'submit-http2-whole-reply session stream
    (http1-reply-parts (head-error-reply status (readiness-set-server-name set)
                                         (readiness-set-retry-after-seconds set) explanation))))

(defun http2-refusal-frames (set octets end status)
  "The frames refusing a connection speaking HTTP/2 whose client sent the
END octets of OCTETS (its preface and frames): the server's SETTINGS, each
stream whose request is whole among them answered STATUS by the engine,
each counted, then GOAWAY NO_ERROR naming the last, so that the client may
send the others again.  One vector of octets."
  (let ((session (make-http2-session :max-concurrent-streams 100 :max-header-bytes 16384 :max-body-bytes 0
                                     :budget (readiness-set-memory-budget set)
                                     :counters (readiness-set-counters set)))
        (frames '()))
    (unwind-protect
         (flet ((take-output ()
                  (take-http2-output session (constantly most-positive-fixnum) (lambda (octets) (push octets frames)))))
           (dolist (stream (receive-http2-octets session octets 0 end))
             (count-refused-head (readiness-set-counters set) status)
             (refuse-http2-stream-with set session stream status))
           ;; The replies first: the library sends a GOAWAY before DATA.
           (take-output)
           (submit-http2-goaway session)
           (take-output))
      (free-http2-session session))
    (apply #'concatenate 'octets (nreverse frames))))
