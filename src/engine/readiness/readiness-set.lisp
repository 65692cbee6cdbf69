;;;; The readiness set of a PARALLEL-ACCEPTOR: one epoll set holding the
;;;; listening socket and every connection that waits for bytes, and the
;;;; table of those connections.  Workers wait on the set; whichever wakes
;;;; takes what is ready.  A worker woken with a token whose slot now holds
;;;; another connection (the generation differs) drops it.
;;;;
;;;; TABLE-LOCK guards the slot table and its free list, taken when a
;;;; connection enters or leaves the table, never around I/O.  See
;;;; connection.lisp for who may touch a connection.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (readiness-set (:constructor %make-readiness-set))
  (epoll-fd -1 :type fixnum :read-only t)
  (wakeup-fd -1 :type fixnum :read-only t)
  ;; The TIMERS called by the workers it wakes (timers.lisp).
  (timers (make-timers) :read-only t)
  ;; The tasks any worker may run (worker-tasks.lisp), oldest first, the
  ;; last cons of the list, whether a nudge is due, and the lock around
  ;; them; the eventfd that wakes a worker for them, in the epoll set
  ;; under +TASK-TOKEN+.  The tasks ever queued and taken, and the count
  ;; queued when the nudge due was armed: those below it are older.
  (tasks '())
  (tasks-tail '())
  (task-nudge-p nil)
  (tasks-queued 0 :type fixnum)
  (tasks-taken 0 :type fixnum)
  (task-nudge-mark 0 :type fixnum)
  ;; Functions CALL-SOON was given, newest first, and whether the timer
  ;; that calls them is set; under TASKS-LOCK too.
  (soon-calls '())
  (soon-timer-p nil)
  (tasks-lock (bt:make-lock "readiness-set-tasks") :read-only t)
  (task-fd (make-wakeup-fd :non-blocking t) :type fixnum :read-only t)
  ;; The acceptor's listening socket, non-blocking.
  (listen-fd -1 :type fixnum :read-only t)
  ;; The address, as text, and the port every connection is accepted on,
  ;; as a list, when the listening socket has one address; NIL when it
  ;; listens on every address of the host (the wildcard), so that each
  ;; connection's is asked of it.
  (local-address nil :type list :read-only t)
  ;; True while accepting pauses: accept(2) failed for a reason that lasts
  ;; (EMFILE, ENFILE), and the listening socket is left disarmed until the
  ;; next sweep, instead of a worker sleeping or spinning on it.
  (accept-paused-p nil)
  ;; True once accepting has stopped for good, for a soft STOP: the
  ;; listening socket is never armed again.
  (accepting-stopped-p nil)
  ;; Threads inside WHEN-ACCEPTING: from the listening socket's report to
  ;; the connection they took entered in the table.
  (accepting-thread-count 0 :type word)
  ;; When the listening socket was last armed (MONOTONIC-MICROSECONDS): how
  ;; long its next report waited behind the connections ready before it
  ;; (TAKE-NEW-CONNECTION).
  (listen-armed-at (monotonic-microseconds) :type fixnum)
  ;; A descriptor held in reserve, so that a message can still be logged when
  ;; the process has no other free (Hunchentoot opens the log file for every
  ;; message); NIL when none could be kept.
  (spare-fd nil)
  (table-lock (bt:make-lock "readiness-set-table") :read-only t)
  ;; Index -> the CONNECTION holding it, or NIL.
  (slots (make-array 1024 :initial-element nil) :type simple-vector)
  (free-indices '())
  (next-index 0 :type fixnum)
  (generation 0 :type fixnum)
  ;; Internal time units a request head may take to arrive.
  (header-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a kept-alive connection may wait for its next request.
  (keep-alive-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a complete request may wait for a free worker.
  (queue-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a reply may wait for its client to take any of it.
  (write-timeout 0 :type fixnum :read-only t)
  ;; Internal time units a request body may stall between two octets.
  (read-timeout 0 :type fixnum :read-only t)
  ;; What the Retry-After header of a 503 says.
  (retry-after-seconds 0 :type fixnum :read-only t)
  ;; What the Server header of a refusal says: the acceptor's server name.
  (server-name "" :type string :read-only t)
  ;; Called with the connection and the status of every refusal, after its
  ;; reply is sent: the acceptor's access log.
  (refusal-logger (constantly nil) :type function :read-only t)
  ;; Called with no argument: true once the set's owner has begun to stop,
  ;; after which no connection is parked again (STOPPING-P, three times a
  ;; request: a closure over what it reads, where asking through the engine
  ;; took five generic calls).
  (stopping-test (constantly nil) :type function :read-only t)
  ;; Connections in the table, held by workers or parked.
  (connection-count 0 :type fixnum)
  ;; Connections whose reply is left to send, parked or being sent.
  (outgoing-count 0 :type word)
  ;; Connections whose request body is arriving, parked or being read.
  (arriving-body-count 0 :type word)
  ;; Connections whose TLS handshake the engine is taking, parked or not.
  (handshake-count 0 :type word)
  ;; Connections that are open websockets.
  (websocket-count 0 :type word)
  ;; Connections whose reply is deferred and not completed yet.
  (deferred-count 0 :type word)
  ;; Connections that are open event streams.
  (event-stream-count 0 :type word)
  ;; Connections that speak HTTP/2.
  (http2-count 0 :type word)
  ;; The engine's CONNECTION-COUNTERS, which this set counts into.
  (counters nil :type connection-counters :read-only t)
  ;; The MEMORY-BUDGET the buffers of this set's connections are taken from.
  (memory-budget nil :type memory-budget :read-only t)
  ;; Workers that have served from this set: the next one counts its
  ;; requests in stripe (mod this +REQUEST-COUNT-STRIPES+).
  (counting-workers 0 :type word))

(defmethod print-object ((set readiness-set) stream)
  (print-unreadable-object (set stream :type t :identity t)
    (format stream "epoll fd ~D, ~D connections, ~D parked"
            (readiness-set-epoll-fd set) (readiness-set-connection-count set) (parked-connection-count set))))

(defun make-readiness-set (listen-socket counters memory-budget
                           &key header-timeout keep-alive-timeout queue-timeout write-timeout read-timeout
                             server-name refusal-logger stopping-test)
  "A readiness set watching LISTEN-SOCKET (made non-blocking: a worker woken
for it may find the connection already taken), counting into COUNTERS,
its connections' buffers taken from MEMORY-BUDGET.  The timeouts are in
seconds; a WRITE-TIMEOUT or READ-TIMEOUT of NIL means a year.  STOPPING-TEST
says when its owner stops (STOPPING-P)."
  (let* ((epoll-fd (make-epoll-set))
         (listen-fd (socket-file-descriptor listen-socket))
         (set (%make-readiness-set :epoll-fd epoll-fd :wakeup-fd (make-wakeup-fd)
                                   :listen-fd listen-fd
                                   :local-address (let ((address (multiple-value-list (socket-address listen-fd :local))))
                                                    (unless (wildcard-address-p (first address))
                                                      address))
                                   :counters counters
                                   :memory-budget memory-budget
                                   :header-timeout (seconds->internal-units header-timeout)
                                   :keep-alive-timeout (seconds->internal-units keep-alive-timeout)
                                   :queue-timeout (seconds->internal-units queue-timeout)
                                   :write-timeout (seconds->internal-units (or write-timeout 31536000))
                                   :read-timeout (seconds->internal-units (or read-timeout 31536000))
                                   :retry-after-seconds (ceiling queue-timeout)
                                   :server-name server-name
                                   :refusal-logger refusal-logger
                                   :stopping-test stopping-test)))
    (setf (readiness-set-spare-fd set) (open-spare-fd))
    (set-non-blocking listen-socket)
    (epoll-watch epoll-fd (readiness-set-listen-fd set) +listen-token+ :trigger :one-shot)
    (epoll-watch epoll-fd (readiness-set-wakeup-fd set) +wakeup-token+)
    (epoll-watch epoll-fd (timers-fd (readiness-set-timers set)) +timer-token+ :trigger :one-shot)
    (epoll-watch epoll-fd (readiness-set-task-fd set) +task-token+ :trigger :one-shot)
    set))

(defun destroy-readiness-set (set)
  (close-fd (readiness-set-epoll-fd set))
  (close-fd (readiness-set-wakeup-fd set))
  (close-fd (readiness-set-task-fd set))
  (destroy-timers (readiness-set-timers set))
  (let ((spare-fd (shiftf (readiness-set-spare-fd set) nil)))
    (when spare-fd (close-fd spare-fd))))

(defun call-with-spare-descriptor (set function)
  "Call FUNCTION with SET's spare descriptor given up, so that FUNCTION can
open one file though the process has no other descriptor free; keep a spare
again afterwards if one can be had.  Called by one thread at a time: the
worker whose accept(2) failed, before it lets another accept."
  (let ((spare-fd (shiftf (readiness-set-spare-fd set) nil)))
    (when spare-fd (close-fd spare-fd))
    (unwind-protect (funcall function)
      (setf (readiness-set-spare-fd set) (open-spare-fd)))))

(defun wake-all-waiters (set)
  "Make every epoll_wait on SET, now and later, return at once."
  (signal-wakeup-fd (readiness-set-wakeup-fd set)))

;;; Accepting.

(defun rearm-listen-socket (set)
  "Arm the listening socket again, unless accepting has stopped: looked at
again after arming, since STOP-ACCEPTING may have disarmed it meanwhile."
  (unless (readiness-set-accepting-stopped-p set)
    (setf (readiness-set-listen-armed-at set) (monotonic-microseconds))
    (epoll-rearm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+)
    (memory-barrier)
    (when (readiness-set-accepting-stopped-p set)
      (epoll-disarm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+))))

(defmacro when-accepting ((set) &body body)
  "Run BODY, which takes connections from SET's listening socket, unless
accepting has stopped; its value, or NIL.  A thread woken for the socket
just before STOP-ACCEPTING would otherwise accept after a soft STOP has
looked at what it must answer (ACCEPTING-ENDED-P); on an inherited socket
what it leaves in the queue is the next acceptor's."
  (let ((counted-set (gensym "SET")))
    `(let ((,counted-set ,set))
       ;; The increment, a locked instruction, is ordered before the read of
       ;; the flag, as STOP-ACCEPTING's write of the flag before its barrier.
       (atomic-increment (readiness-set-accepting-thread-count ,counted-set))
       (unwind-protect
            (unless (readiness-set-accepting-stopped-p ,counted-set)
              ,@body)
         (atomic-decrement (readiness-set-accepting-thread-count ,counted-set))))))

(defun stop-accepting (set)
  "Take no connection from the listening socket any more."
  (setf (readiness-set-accepting-stopped-p set) t)
  (memory-barrier)
  (epoll-disarm (readiness-set-epoll-fd set) (readiness-set-listen-fd set) +listen-token+))

(defun accepting-ended-p (set)
  "True once STOP-ACCEPTING has been called on SET and no thread is still
taking a connection: every connection taken is in the table by now."
  (and (readiness-set-accepting-stopped-p set)
       (zerop (readiness-set-accepting-thread-count set))))

(defun refuse-connections (set)
  "Make SET's listening socket, whose accepting has stopped, stop listening:
the kernel refuses a client connecting from now on (ECONNREFUSED, which a
load balancer retries elsewhere at once), where closing the socket later
would reset those it had queued.  The descriptor stays open until the
listening socket is closed, so its number is not taken by another socket
while a worker may still name it; it leaves the epoll set first, which
would otherwise report its hang-up to every wait until then."
  (epoll-forget (readiness-set-epoll-fd set) (readiness-set-listen-fd set))
  (shut-down-fd (readiness-set-listen-fd set)))

(defun pause-accepting (set)
  "Leave the listening socket disarmed until RESUME-ACCEPTING."
  (setf (readiness-set-accept-paused-p set) t))

(defun resume-accepting (set)
  "Arm the listening socket again if accepting was paused."
  (when (readiness-set-accept-paused-p set)
    (setf (readiness-set-accept-paused-p set) nil)
    (rearm-listen-socket set)))

;;; The table.

(defun slot-index (token)
  (- (ldb (byte 32 0) token) +first-connection-token+))

(defun add-connection (set fd fd-stream)
  "Enter the accepted connection FD, with its FD-STREAM, into SET's table;
its CONNECTION, :ACTIVE."
  (bt:with-lock-held ((readiness-set-table-lock set))
    (let* ((index (or (pop (readiness-set-free-indices set))
                      (prog1 (readiness-set-next-index set)
                        (incf (readiness-set-next-index set)))))
           (generation (setf (readiness-set-generation set)
                             (ldb (byte 31 0) (1+ (readiness-set-generation set)))))
           (connection (make-connection fd (dpb generation (byte 31 32) (+ index +first-connection-token+))
                                        fd-stream)))
      (when (>= index (length (readiness-set-slots set)))
        (setf (readiness-set-slots set)
              (replace (make-array (* 2 (length (readiness-set-slots set))) :initial-element nil)
                       (readiness-set-slots set))))
      (setf (svref (readiness-set-slots set) index) connection)
      (incf (readiness-set-connection-count set))
      connection)))

(defun remove-connection (set connection)
  "Take CONNECTION, which the caller holds, out of SET's table."
  (setf (connection-state connection) :closed)
  (bt:with-lock-held ((readiness-set-table-lock set))
    (let ((index (slot-index (connection-token connection))))
      (when (eq (svref (readiness-set-slots set) index) connection)
        (setf (svref (readiness-set-slots set) index) nil)
        (push index (readiness-set-free-indices set))
        (decf (readiness-set-connection-count set))))))

;;; Parking and taking.

(defun take-parked-connection (connection)
  "Make the caller CONNECTION's holder if it is parked.  True when it was.
What it had unread stays so."
  (compare-and-swap (connection-state connection) :parked :active))

(defun slot-connection (set token)
  "The connection in SET's table at the slot TOKEN names, or NIL when the
slot is empty or TOKEN names none (the set's own descriptors, the
listening socket).  It may be a later connection's: the caller compares
tokens."
  (let ((slots (readiness-set-slots set))
        (index (slot-index token)))
    (and (< -1 index (length slots)) (svref slots index))))

(defun prefetch-reported-connection (set token)
  "Ask for the connection TOKEN was reported for, if it is a connection's,
into the caches: a worker takes it up soon (TAKE-READY-CONNECTION)."
  (let ((connection (slot-connection set token)))
    (when connection
      (prefetch-octets connection *connection-octets*))))

(defun prefetch-reported-connection-objects (set token)
  "Ask for what a turn of the connection TOKEN was reported for, if it is a
connection's, reads first beyond its struct into the caches: its socket's
first line, whose class HUNCHENTOOT:PROCESS-CONNECTION's dispatch reads,
and the conses of its own addresses, which each request is made with.  Its
struct was asked for as TOKEN was queued (PREFETCH-REPORTED-CONNECTION) and
has come by now; a worker takes it up after the turn running now."
  (let ((connection (slot-connection set token)))
    (when connection
      (let ((socket (connection-usocket connection))
            (addresses (connection-addresses connection)))
        (when socket (prefetch-octets socket 8))
        ;; The peer's address and port: two conses made at accept, before
        ;; the set's own address, which every connection shares.
        (when addresses (prefetch-octets addresses 32))))))

(defun take-ready-connection (set token)
  "The parked connection TOKEN was reported for, now held by the caller; NIL
when it is gone or another thread holds it.  A connection held by another
thread is marked :NOTIFIED, so that its holder arms it again when it parks
(the edge reported now would otherwise be lost).  What was reported is
unread."
  (let ((connection (slot-connection set token)))
    (when (and connection (= (connection-token connection) token))
      (loop
        (case (connection-state connection)
          (:parked (when (take-parked-connection connection)
                     (setf (connection-unread-p connection) t)
                     (return connection)))
          (:active (when (compare-and-swap (connection-state connection) :active :notified)
                     (return nil)))
          (t (return nil)))))))

(defun park-connection (set connection deadline)
  "Give up CONNECTION until what it is AWAITING happens -- bytes arrive, or
its socket has room -- or DEADLINE passes (then it gets its
TIMEOUT-STATUS).  True when it is parked (and may already be another
thread's); false when the descriptor could not be armed and the caller
still holds the connection.  A plain connection is watched edge-triggered
from its first park on, and parks without a system call when what it
awaits has not changed and nothing it was told of is unread; a TLS one
one-shot, armed at each park (OpenSSL may hold records it read ahead,
which no edge would report)."
  (let ((trigger (or (connection-trigger connection)
                     (if (plain-connection-p connection) :edge :one-shot)))
        (awaiting (connection-awaiting connection))
        (first-time-p (null (connection-trigger connection))))
    (let ((arm-p (or first-time-p
                     (eq trigger :one-shot)
                     (connection-unread-p connection)
                     (not (eq awaiting (connection-armed-for connection))))))
      ;; Everything the next holder reads is written before the connection
      ;; is published :PARKED: it may be taken before epoll_ctl returns.
      (setf (connection-deadline connection) deadline
            (connection-trigger connection) trigger
            (connection-armed-for connection) awaiting
            (connection-unread-p connection) nil)
      (unless (compare-and-swap (connection-state connection) :active :parked)
        ;; :NOTIFIED: an edge came while the caller held it.
        (setf arm-p t
              (connection-state connection) :parked))
      (or (cond ((not arm-p) t)
                (first-time-p (epoll-watch (readiness-set-epoll-fd set) (connection-fd connection)
                                           (connection-token connection) :trigger trigger :awaited awaiting))
                (t (epoll-rearm (readiness-set-epoll-fd set) (connection-fd connection)
                                (connection-token connection) :trigger trigger :awaited awaiting)))
          ;; Not armed; the sweeper may have taken it at its deadline meanwhile.
          (not (take-parked-connection connection))))))

(defun parked-connection-count (set)
  "The connections parked in SET now, counted when asked: a count kept at
every park and take would be a word all workers write twice a request."
  (count-if (lambda (connection) (and connection (eq (connection-state connection) :parked)))
            (readiness-set-slots set)))

(defun map-parked-connections (set function)
  "Call FUNCTION on every connection parked in SET now.  It is not taken: it
may be taken by a worker before or while FUNCTION runs."
  (let ((slots (readiness-set-slots set)))
    (loop for connection across slots
          when (and connection (eq (connection-state connection) :parked))
            do (funcall function connection))))

;;; The set's own one-shot descriptors.

(defun rearm-own-descriptor (set token)
  "Arm again the timer or task descriptor of SET that TOKEN names: watched
one-shot, each is reported once until armed again, and reported again at
once while it is still readable."
  (epoll-rearm (readiness-set-epoll-fd set)
               (if (= token +timer-token+) (timers-fd (readiness-set-timers set)) (readiness-set-task-fd set))
               token))

;;; Timers.

(defun run-due-timers (set acceptor)
  "Call the timers of SET that are due, in the worker its timerfd woke,
after arming the descriptor again; an error escaping a timer's function is
logged in ACCEPTOR's message log."
  (let* ((timers (readiness-set-timers set))
         (due (take-due-timers timers)))
    (rearm-own-descriptor set +timer-token+)
    (dolist (timer due)
      (atomic-increment (timers-fired-count timers))
      (handler-case (funcall (timer-function timer))
        (error (condition)
          (log-safely acceptor :error "Error in a timer's function: ~A" condition))))))
