;;;; RECYCLING-TASKMASTER: a pool of worker threads that all accept on the
;;;; acceptor's one listening socket, grown by one thread-making thread and
;;;; shrunk by idle workers retiring themselves.
;;;;
;;;; Locking discipline.  POOL-LOCK guards every mutable slot of the
;;;; taskmaster and the SOCKET of every worker.  Each change of pool state
;;;; is one small NOTE-... or CLAIM-... function that takes the lock itself,
;;;; with interrupts deferred, so that HUNCHENTOOT:STOP's interrupts never
;;;; see half a change.  The lock is never held across socket I/O, thread
;;;; creation or joining.  Waits on POOL-CHANGED hold it as condition
;;;; waits do, with interrupts allowed: a waiting worker is never in a
;;;; state that is cut, and nothing interrupts the thread-making thread.
;;;;
;;;; Per request, a worker takes no lock: it only writes its own STATE (one
;;;; word) and REQUESTS-SERVED.  Between requests it writes STATE, then,
;;;; after a memory barrier, reads SHUTTING-DOWN-P; BEGIN-SHUTDOWN writes
;;;; SHUTTING-DOWN-P under the lock, and the stopping thread reads STATEs
;;;; after taking the lock.  So either the worker sees the stop, or the stop
;;;; sees the worker waiting and cuts it.
;;;;
;;;; Interrupts.  Only HUNCHENTOOT:SHUTDOWN and the thread-making thread
;;;; interrupt a worker, and only to end the connection it serves.  The
;;;; interrupt runs in the worker and throws only if the worker is inside a
;;;; cut point (WITH-CONNECTION-CUT-POINT, the throw's catcher) and still in
;;;; one of the states it was aimed at, so it is harmless when it arrives
;;;; early or late.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *default-standby-thread-count* 8
  "The STANDBY-THREAD-COUNT of a RECYCLING-TASKMASTER made without one: how
many workers wait on the listening socket when there is no load.")

(defconstant +reclaim-idle-after-milliseconds+ 50
  "How long a kept-alive connection must have waited for its next request
before a saturated pool closes it for a queued connection.  Closing one that
was idle for less would race the client's next request, which then fails.")

(defconstant +yield-after-milliseconds+ 100
  "How long a connection may wait in the queue before workers end their
kept-alive connections for it.  Yielding at once would turn every reply
into \"Connection: close\" while the pool is saturated.")

(defconstant +queue-room-grace-milliseconds+ 5
  "How long a connection accepted for a full queue waits for room before it
is answered 503.  A client that reconnects as soon as it has its reply can
arrive before the worker that sent the reply has let go of its connection.")

(defconstant +overflow-poll-milliseconds+ 20
  "How long one overflow round of the thread-making thread waits for a
connection before looking at the pool again.")

(defgeneric taskmaster-standby-thread-count (taskmaster)
  (:documentation "How many workers TASKMASTER keeps waiting on the listening
socket when there is no load."))

(defgeneric taskmaster-thread-idle-timeout (taskmaster)
  (:documentation "Seconds a worker of TASKMASTER waits in accept(2) before
it looks at the pool; a surplus worker that waited this long retires."))

(defgeneric taskmaster-stop-timeout (taskmaster)
  (:documentation "Seconds HUNCHENTOOT:STOP waits for TASKMASTER's workers to
end, after asking them to, before it signals
RECYCLING-TASKMASTER-CORRUPTED-ERROR."))

(defstruct (worker (:constructor make-worker (taskmaster)))
  "One pooled thread.  STATE is one of :STARTING, :READY (between
connections), :EXITING (counted out of the pool), :IN-REQUEST (from a
complete head to the reply sent), and, with the blocking engine, :ACCEPTING
(in accept(2)), :CONNECTED (holds a connection, not yet reading), :READING
(waiting for the first request head of a connection), :IDLE (waiting for a
later request on a kept-alive connection); with the readiness-set engine,
:WAITING (in epoll_wait), :HANDSHAKING (starting TLS on a new connection),
:SERVING (reading heads that have arrived)."
  (taskmaster nil :read-only t)
  ;; The readiness-set engine reads request heads into this octet vector.
  (head-buffer nil)
  (thread nil)
  (state :starting :type keyword)
  (socket nil)
  (idle-since 0 :type fixnum)
  (cut-requested-p nil)
  (requests-served 0 :type fixnum))

(defmethod print-object ((worker worker) stream)
  ;; The default would print the head buffer, 32 KiB of octets.
  (print-unreadable-object (worker stream :type t :identity t)
    (format stream "~S, ~D requests" (worker-state worker) (worker-requests-served worker))))

(defvar *worker* nil
  "The WORKER record of the current thread; NIL outside worker threads.")

(defclass recycling-taskmaster (hunchentoot:multi-threaded-taskmaster)
  ((standby-thread-count
    :initarg :standby-thread-count
    :reader taskmaster-standby-thread-count
    :documentation "How many workers wait on the listening socket when there
is no load: started by HUNCHENTOOT:START and kept when idle workers retire.")
   (max-thread-count
    :initarg :max-thread-count
    :reader hunchentoot:taskmaster-max-thread-count
    :documentation "The most workers the pool may hold, or NIL for no limit.
When all of them are busy, new connections are queued or refused with 503,
as MAX-ACCEPT-COUNT says.")
   (max-accept-count
    :initarg :max-accept-count
    :reader hunchentoot:taskmaster-max-accept-count
    :documentation "The most connections held at once (served plus queued)
before new ones get 503, or NIL to answer 503 as soon as every one of
MAX-THREAD-COUNT workers is busy.  Hunchentoot's meaning.")
   (thread-idle-timeout
    :initarg :thread-idle-timeout
    :reader taskmaster-thread-idle-timeout
    :documentation "Seconds a worker waits in accept(2) before it looks at
the pool; a surplus worker that waited this long retires.")
   (stop-timeout
    :initarg :stop-timeout
    :reader taskmaster-stop-timeout
    :documentation "Seconds HUNCHENTOOT:STOP waits for workers to end once
asked, before it calls the pool corrupted.")
   (readiness-set
    :initform nil :accessor taskmaster-readiness-set
    :documentation "The READINESS-SET the workers wait on while the acceptor
runs with the :READINESS-SET engine; NIL with the blocking engine.")
   (pool-lock :initform (bt:make-lock "recycling-taskmaster-pool") :reader pool-lock)
   (pool-changed
    :initform (bt:make-condition-variable) :reader pool-changed
    :documentation "Notified when a worker ends, starts accepting, finishes a
request, or an overflow round ends.")
   (maker-wakeup
    :initform (bt:make-condition-variable) :reader maker-wakeup
    :documentation "Notified when the thread-making thread has work: a thread
to make, a saturated pool, or shutdown.")
   (workers :initform '() :accessor pool-workers
            :documentation "Every live worker thread's record, retiring ones included.")
   (thread-maker :initform nil :accessor thread-maker
                 :documentation "The one thread that makes worker threads and
accepts on behalf of a saturated pool.")
   (thread-count :initform 0 :accessor pool-thread-count
                 :documentation "Workers in the pool, not counting those retiring.")
   (pending-thread-count :initform 0 :accessor pending-thread-count
                         :documentation "Workers asked of the thread-making thread, not yet made.")
   (accepting-count :initform 0 :accessor accepting-count
                    :documentation "Workers in (or entering) accept(2).")
   (busy-count :initform 0 :accessor busy-count
               :documentation "Workers holding a connection.")
   (queued-connections :initform '() :accessor queued-connections
                       :documentation "Connections accepted while the pool was saturated, oldest
first, each as (socket . internal-real-time when queued).")
   (overflow-accepting-p :initform nil :accessor overflow-accepting-p
                         :documentation "True while the thread-making thread accepts for a
saturated pool; workers then take from the queue instead of accepting.")
   (shutting-down-p :initform nil :accessor shutting-down-p)
   (soft-stop-p :initform nil :accessor soft-stop-p
                :documentation "True when the current HUNCHENTOOT:STOP is soft.")
   (connections-accepted :initform 0 :accessor connections-accepted
                         :documentation "Connections taken from the listening socket and served or queued, ever.")
   (connections-rejected :initform 0 :accessor connections-rejected
                         :documentation "Connections answered 503 because the pool was full, ever.")
   (threads-created :initform 0 :accessor threads-created
                    :documentation "Worker threads made, ever.")
   (threads-retired :initform 0 :accessor threads-retired
                    :documentation "Worker threads that ended because they were surplus, ever.")
   (peak-thread-count :initform 0 :accessor peak-thread-count
                      :documentation "The most workers the pool has held at once.")
   (connection-counters
    :initform (make-connection-counters) :reader connection-counters
    :documentation "What the readiness sets of every run have counted, ever.")
   (retired-requests-served :initform 0 :accessor retired-requests-served
                            :documentation "Requests served by workers that have ended.")
   (last-rejection-log-time :initform 0 :accessor last-rejection-log-time))
  (:default-initargs
   :standby-thread-count *default-standby-thread-count*
   :max-thread-count (default-max-thread-count)
   :max-accept-count (default-max-accept-count)
   :thread-idle-timeout 1
   :stop-timeout 10)
  (:documentation "A taskmaster whose pooled worker threads all block in
accept(2) on the acceptor's listening socket and serve the connections they
accept themselves: no listener thread hands sockets over.  The pool starts
with STANDBY-THREAD-COUNT workers; when none is left accepting, the one
thread-making thread adds one, up to MAX-THREAD-COUNT; surplus workers
retire after THREAD-IDLE-TIMEOUT seconds without a connection.  When every
allowed worker is busy, the thread-making thread accepts in their place,
queueing connections up to MAX-ACCEPT-COUNT and answering 503 past it, and
asks workers to close kept-alive connections so that queued ones are
served.  Needs a PARALLEL-ACCEPTOR."))

(defun check-count (initarg value &key (minimum 0) (null-allowed nil))
  (unless (or (and null-allowed (null value))
              (and (integerp value) (<= minimum value)))
    (error 'invalid-taskmaster-configuration
           :initarg initarg :value value
           :reason (format nil "must be an integer of at least ~D~:[~; or NIL~]"
                           minimum null-allowed))))

(defmethod initialize-instance :after ((taskmaster recycling-taskmaster) &key)
  (let ((standby (taskmaster-standby-thread-count taskmaster))
        (max-threads (hunchentoot:taskmaster-max-thread-count taskmaster))
        (max-accepts (hunchentoot:taskmaster-max-accept-count taskmaster))
        (idle-timeout (taskmaster-thread-idle-timeout taskmaster))
        (stop-timeout (taskmaster-stop-timeout taskmaster)))
    ;; One standby worker at least: growth starts when an accepting worker
    ;; takes a connection, so a pool of none would never start.
    (check-count :standby-thread-count standby :minimum 1)
    (check-count :max-thread-count max-threads :minimum 1 :null-allowed t)
    (check-count :max-accept-count max-accepts :minimum 1 :null-allowed t)
    (loop for (initarg seconds) in `((:thread-idle-timeout ,idle-timeout)
                                     (:stop-timeout ,stop-timeout))
          unless (and (realp seconds) (plusp seconds))
            do (error 'invalid-taskmaster-configuration
                      :initarg initarg :value seconds
                      :reason "must be a positive number of seconds"))
    (when (and max-threads (< max-threads standby))
      (error 'invalid-taskmaster-configuration
             :initarg :standby-thread-count :value standby
             :reason (format nil "is above :MAX-THREAD-COUNT ~D" max-threads)))
    (when max-accepts
      (unless max-threads
        (error 'invalid-taskmaster-configuration
               :initarg :max-accept-count :value max-accepts
               :reason "needs a :MAX-THREAD-COUNT"))
      (unless (> max-accepts max-threads)
        (error 'invalid-taskmaster-configuration
               :initarg :max-accept-count :value max-accepts
               :reason (format nil "must be greater than :MAX-THREAD-COUNT ~D" max-threads))))))

(defmacro with-pool-lock ((taskmaster) &body body)
  "Run BODY holding POOL-LOCK.  For BODYs that wait on a condition variable."
  `(bt:with-lock-held ((pool-lock ,taskmaster)) ,@body))

(defmacro with-pool-state-change ((taskmaster) &body body)
  "Run BODY holding POOL-LOCK with interrupts deferred.  BODY must not wait."
  `(without-interrupts (with-pool-lock (,taskmaster) ,@body)))

(defun notify-pool-changed (taskmaster)
  (condition-broadcast (pool-changed taskmaster)))

(defun notify-thread-maker (taskmaster)
  (bt:condition-notify (maker-wakeup taskmaster)))

(defun taskmaster-listen-socket (taskmaster)
  (acceptor-listen-socket (hunchentoot:taskmaster-acceptor taskmaster)))

;;; Questions about the pool, asked with POOL-LOCK held.

(defun pool-may-grow-p (taskmaster)
  (let ((max-threads (hunchentoot:taskmaster-max-thread-count taskmaster)))
    (and (not (shutting-down-p taskmaster))
         (or (null max-threads)
             (< (+ (pool-thread-count taskmaster) (pending-thread-count taskmaster))
                max-threads)))))

(defun pool-saturated-p (taskmaster)
  "True when every worker holds a connection and no more may be made."
  (and (not (shutting-down-p taskmaster))
       (>= (busy-count taskmaster) (pool-thread-count taskmaster))
       (zerop (pending-thread-count taskmaster))
       (not (pool-may-grow-p taskmaster))))

(defun notify-thread-maker-if-saturated (taskmaster)
  "Every change that can leave all workers busy calls this: the thread-making
thread, asleep since it last found a free worker, must start accepting."
  (when (pool-saturated-p taskmaster)
    (notify-thread-maker taskmaster)))

(defun queue-has-room-p (taskmaster)
  (let ((max-accepts (hunchentoot:taskmaster-max-accept-count taskmaster)))
    (and max-accepts
         (< (+ (busy-count taskmaster) (length (queued-connections taskmaster)))
            max-accepts))))

(defun milliseconds->internal-units (milliseconds)
  (floor (* milliseconds internal-time-units-per-second) 1000))

(defun yield-kept-alive-connections-p (taskmaster)
  "True when a worker should close its kept-alive connection after the
current reply, because a connection has waited in the queue too long.  Read
without the lock: a stale answer costs one reply's worth of waiting."
  (let ((oldest (first (queued-connections taskmaster))))
    (and oldest
         (> (- (get-internal-real-time) (cdr oldest))
            (milliseconds->internal-units +yield-after-milliseconds+)))))

;;; State changes of a worker.

(defun claim-next-task (taskmaster worker)
  "Decide what WORKER does next.  Returns :EXIT, (values :SERVE socket) for a
queued connection, or :ACCEPT after counting WORKER as accepting."
  (with-pool-lock (taskmaster)
    (loop while (and (overflow-accepting-p taskmaster)
                     (not (shutting-down-p taskmaster))
                     (null (queued-connections taskmaster)))
          do (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster)))
    (without-interrupts
      (when (eq (worker-state worker) :starting)
        ;; START waits for every standby worker to get here.
        (notify-pool-changed taskmaster))
      (cond ((shutting-down-p taskmaster) :exit)
            ((queued-connections taskmaster)
             (let ((socket (car (pop (queued-connections taskmaster)))))
               (setf (worker-state worker) :connected
                     (worker-socket worker) socket)
               (incf (busy-count taskmaster))
               (notify-thread-maker-if-saturated taskmaster)
               (values :serve socket)))
            (t
             (setf (worker-state worker) :accepting)
             (incf (accepting-count taskmaster))
             :accept)))))

(defun note-accepted (taskmaster worker socket)
  "WORKER left accept(2) with SOCKET.  If it was the last one accepting, ask
for another worker, or for overflow accepting when the pool is full."
  (with-pool-state-change (taskmaster)
    (decf (accepting-count taskmaster))
    (incf (busy-count taskmaster))
    (incf (connections-accepted taskmaster))
    (setf (worker-state worker) :connected
          (worker-socket worker) socket)
    (when (zerop (accepting-count taskmaster))
      (when (pool-may-grow-p taskmaster)
        (incf (pending-thread-count taskmaster)))
      (notify-thread-maker taskmaster))))

(defun note-accept-timed-out (taskmaster worker)
  "WORKER left accept(2) with nothing.  Returns true when WORKER is surplus
and retires now.  The last accepting worker never retires: growth starts
only when an accepting worker takes a connection."
  (with-pool-state-change (taskmaster)
    (decf (accepting-count taskmaster))
    (setf (worker-state worker) :ready)
    (retire-if-surplus taskmaster worker (accepting-count taskmaster))))

(defun retire-if-surplus (taskmaster worker other-waiting-count)
  "Count WORKER out of the pool if the pool is above standby and
OTHER-WAITING-COUNT other workers still wait for connections: the last
waiting worker never retires, since growth starts only when a waiting
worker is woken.  True when WORKER retires.  POOL-LOCK held."
  (when (and (not (shutting-down-p taskmaster))
             (> (pool-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))
             (plusp other-waiting-count))
    (setf (worker-state worker) :exiting)
    (decf (pool-thread-count taskmaster))
    (incf (threads-retired taskmaster))
    t))

(defun note-waiting-for-request (taskmaster worker first-request-p)
  "WORKER is about to wait for a request head.  Returns false when the
taskmaster is stopping, and the connection should end instead."
  (unless first-request-p
    (setf (worker-idle-since worker) (get-internal-real-time)))
  (setf (worker-state worker) (if first-request-p :reading :idle))
  (memory-barrier)
  (not (or (shutting-down-p taskmaster)
           (acceptor-shutting-down-p (hunchentoot:taskmaster-acceptor taskmaster)))))

(defun note-request-started (worker)
  (setf (worker-state worker) :in-request))

(defun note-request-finished (taskmaster worker)
  (incf (worker-requests-served worker))
  (setf (worker-state worker) :connected)
  (when (shutting-down-p taskmaster)
    (with-pool-lock (taskmaster)
      (notify-pool-changed taskmaster))))

(defun in-request-count (taskmaster)
  "Workers inside a request, from its head read to its reply sent.  Call
with POOL-LOCK held."
  (count :in-request (pool-workers taskmaster) :key #'worker-state))

(defun note-connection-finished (taskmaster worker)
  (with-pool-state-change (taskmaster)
    (setf (worker-state worker) :ready
          (worker-socket worker) nil
          (worker-cut-requested-p worker) nil)
    (decf (busy-count taskmaster))
    (when (overflow-accepting-p taskmaster)
      ;; The thread-making thread may be waiting for queue room.
      (notify-pool-changed taskmaster))))

(defun note-worker-exited (taskmaster worker)
  "WORKER's thread is ending, normally or not.  Undo whatever its state still
counts, and ask for a replacement if the pool fell below standby."
  (with-pool-state-change (taskmaster)
    (if (taskmaster-readiness-set taskmaster)
        (forget-readiness-worker taskmaster worker)
        (forget-blocking-worker taskmaster worker))
    (setf (worker-state worker) :exiting)
    (incf (retired-requests-served taskmaster) (worker-requests-served worker))
    (setf (pool-workers taskmaster) (delete worker (pool-workers taskmaster)))
    (when (and (not (shutting-down-p taskmaster))
               (< (+ (pool-thread-count taskmaster) (pending-thread-count taskmaster))
                  (taskmaster-standby-thread-count taskmaster)))
      (incf (pending-thread-count taskmaster)))
    (notify-thread-maker taskmaster)
    (notify-pool-changed taskmaster)))

(defun forget-blocking-worker (taskmaster worker)
  "Undo what the blocking engine's WORKER still counts.  POOL-LOCK held."
  (case (worker-state worker)
    (:exiting)
    (:accepting
     (decf (accepting-count taskmaster))
     (decf (pool-thread-count taskmaster))
     (when (and (zerop (accepting-count taskmaster)) (pool-may-grow-p taskmaster))
       (incf (pending-thread-count taskmaster))))
    ((:connected :reading :idle :in-request)
     (decf (busy-count taskmaster))
     (decf (pool-thread-count taskmaster)))
    (t (decf (pool-thread-count taskmaster)))))

(defun forget-readiness-worker (taskmaster worker)
  "Undo what the readiness-set engine's WORKER still counts.  POOL-LOCK held."
  (case (worker-state worker)
    (:exiting)
    (:waiting
     (atomic-decrement (readiness-set-waiting-count (taskmaster-readiness-set taskmaster)))
     (decf (pool-thread-count taskmaster)))
    (t (decf (pool-thread-count taskmaster)))))

;;; State changes of a worker of the readiness-set engine.  The count of
;;; waiting workers is atomic, not locked: it changes twice per request.

(defun note-waiting (set worker)
  (without-interrupts
    (setf (worker-state worker) :waiting)
    (atomic-increment (readiness-set-waiting-count set))))

(defun note-stopped-waiting (set worker)
  (without-interrupts
    (setf (worker-state worker) :ready)
    (atomic-decrement (readiness-set-waiting-count set))))

(defun note-woken (taskmaster set worker)
  "WORKER left epoll_wait with something to serve.  If it was the last one
waiting, ask the thread-making thread for another worker."
  (when (= 1 (without-interrupts
               (setf (worker-state worker) :serving)
               (atomic-decrement (readiness-set-waiting-count set))))
    (with-pool-state-change (taskmaster)
      (when (and (zerop (readiness-set-waiting-count set))
                 (zerop (pending-thread-count taskmaster))
                 (pool-may-grow-p taskmaster))
        (incf (pending-thread-count taskmaster))
        (notify-thread-maker taskmaster)))))

(defun note-wait-timed-out (taskmaster set worker)
  "WORKER waited THREAD-IDLE-TIMEOUT seconds for nothing.  True when it is
surplus and retires now; the last waiting worker never retires."
  (with-pool-state-change (taskmaster)
    (when (retire-if-surplus taskmaster worker (1- (readiness-set-waiting-count set)))
      (atomic-decrement (readiness-set-waiting-count set))
      t)))

(defun note-handshake-started (taskmaster worker)
  "WORKER is about to start a new connection's stream: the TLS handshake, on
an SSL acceptor.  False when the taskmaster is stopping and the connection
should end instead (STOP sets its flag before it looks for handshakes to cut)."
  (setf (worker-state worker) :handshaking)
  (memory-barrier)
  (not (shutting-down-p taskmaster)))

(defun note-handshake-finished (worker)
  (setf (worker-state worker) :serving))

(defun next-ready-token (taskmaster worker set)
  "Wait on SET until WORKER has something to serve: the token reported, or
NIL when WORKER is to end (the taskmaster is stopping, or WORKER is surplus)."
  (note-waiting set worker)
  (flet ((idle-deadline ()
           (+ (get-internal-real-time)
              (seconds->internal-units (taskmaster-thread-idle-timeout taskmaster)))))
    (let ((idle-deadline (idle-deadline)))
      (loop
        (when (shutting-down-p taskmaster)
          (note-stopped-waiting set worker)
          (return nil))
        (let ((token (epoll-wait-one (readiness-set-epoll-fd set) (milliseconds-until idle-deadline))))
          (case token
            (:interrupted)
            (:timeout
             (when (>= (get-internal-real-time) idle-deadline)
               (when (note-wait-timed-out taskmaster set worker)
                 (return nil))
               (setf idle-deadline (idle-deadline))))
            (t
             ;; The wakeup descriptor means stop, seen at the top of the loop.
             (unless (= token +wakeup-token+)
               (note-woken taskmaster set worker)
               (return token)))))))))

;;; Ending a worker's connection from another thread.

(defun claim-workers-to-cut (taskmaster states &key (limit nil) (idle-for 0))
  "Mark up to LIMIT (default all) workers in STATES, not marked already, as
about to be cut, and return them.  IDLE-FOR (internal time units) further
demands that long an idle wait.  Marking first means one interrupt per
connection: interrupts sent faster than a worker unwinds nest until SBCL
dies."
  (with-pool-state-change (taskmaster)
    (loop with now = (get-internal-real-time)
          for worker in (pool-workers taskmaster)
          while (or (null limit) (< (length chosen) limit))
          when (and (member (worker-state worker) states)
                    (not (worker-cut-requested-p worker))
                    (>= (- now (worker-idle-since worker)) idle-for))
            collect (progn (setf (worker-cut-requested-p worker) t) worker) into chosen
          finally (return chosen))))

(defvar *connection-cut-point-p* nil
  "True in a worker thread inside WITH-CONNECTION-CUT-POINT, where
CUT-CONNECTION's throw has its catcher.")

(defmacro with-connection-cut-point (() &body body)
  "Run BODY where CUT-CONNECTION may end it; a cut returns NIL from here.
A worker enters the states CUT-CONNECTION is asked to cut only inside one,
but the interrupt may still land just before or after it."
  `(catch 'connection-cut
     (let ((*connection-cut-point-p* t))
       ,@body)))

(defun cut-connection (worker states)
  "Make WORKER drop its connection if, when the interrupt runs, it is inside a
cut point and in one of STATES.  If it is not, it becomes eligible to be cut
again."
  (let ((thread (worker-thread worker)))
    (when thread
      (ignore-errors
       (bt:interrupt-thread thread
                            (lambda ()
                              (if (and *connection-cut-point-p*
                                       (member (worker-state worker) states))
                                  (throw 'connection-cut nil)
                                  (setf (worker-cut-requested-p worker) nil))))))))

;;; The worker thread.

(defun accept-connection (taskmaster)
  "Accept one connection from the listening socket: a usocket, or NIL when
accept(2) timed out or failed."
  (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster))
        (socket nil))
    (handler-case
        (progn
          (setf socket (usocket:socket-accept (acceptor-listen-socket acceptor)
                                              :element-type '(unsigned-byte 8)))
          (when socket
            (apply-connection-timeouts acceptor socket))
          socket)
      (usocket:connection-aborted-error () nil)
      (error (condition)
        ;; A connection accepted but not set up is closed, not leaked.
        (when socket
          (ignore-errors (usocket:socket-close socket)))
        (note-accept-failed taskmaster condition)
        nil))))

(defun note-accept-failed (taskmaster condition)
  "accept(2) failed with CONDITION.  EMFILE and the like persist: log it and
pause, so that the worker does not spin on it.  Quiet while stopping."
  (unless (shutting-down-p taskmaster)
    (hunchentoot:acceptor-log-message (hunchentoot:taskmaster-acceptor taskmaster) :error
                                      "accept failed: ~A" condition)
    (sleep 0.1)))

(defun next-connection (taskmaster worker)
  "Block until WORKER has a connection to serve, queued or accepted.  NIL when
the worker is to end: the taskmaster is stopping or the worker is surplus."
  (loop
    (multiple-value-bind (task socket) (claim-next-task taskmaster worker)
      (ecase task
        (:exit (return nil))
        (:serve (return socket))
        (:accept
         (let ((socket (accept-connection taskmaster)))
           (cond (socket
                  (note-accepted taskmaster worker socket)
                  (return socket))
                 ((note-accept-timed-out taskmaster worker)
                  (return nil)))))))))

(defun serve-connection (taskmaster worker socket)
  (with-connection-cut-point ()
    (unwind-protect
         (hunchentoot:handle-incoming-connection taskmaster socket)
      (note-connection-finished taskmaster worker))))

(defun run-worker (taskmaster worker)
  (setf (worker-thread worker) (bt:current-thread))
  (let ((*worker* worker))
    (unwind-protect
         (if (taskmaster-readiness-set taskmaster)
             (run-readiness-worker taskmaster worker)
             (loop for socket = (next-connection taskmaster worker)
                   while socket
                   do (serve-connection taskmaster worker socket)))
      (note-worker-exited taskmaster worker))))

(defmethod hunchentoot:handle-incoming-connection ((taskmaster recycling-taskmaster) socket)
  (hunchentoot:process-connection (hunchentoot:taskmaster-acceptor taskmaster) socket))

;;; The thread-making thread.

(defconstant +sweep-interval-seconds+ 1/4
  "How often the thread-making thread ends parked connections whose deadline
has passed: the precision of the header and keep-alive timeouts.")

(defun next-maker-task (taskmaster)
  "Wait for work for the thread-making thread: :EXIT, :MAKE-THREAD,
:OVERFLOW (after marking the overflow round begun; blocking engine) or
:SWEEP (readiness-set engine, every +SWEEP-INTERVAL-SECONDS+)."
  (with-pool-lock (taskmaster)
    (let ((sweep-deadline (+ (get-internal-real-time) (seconds->internal-units +sweep-interval-seconds+))))
      (loop
        (cond ((shutting-down-p taskmaster) (return :exit))
              ((plusp (pending-thread-count taskmaster)) (return :make-thread))
              ((null (taskmaster-readiness-set taskmaster))
               (if (pool-saturated-p taskmaster)
                   (progn (setf (overflow-accepting-p taskmaster) t)
                          (return :overflow))
                   (bt:condition-wait (maker-wakeup taskmaster) (pool-lock taskmaster))))
              ((>= (get-internal-real-time) sweep-deadline) (return :sweep))
              (t (bt:condition-wait (maker-wakeup taskmaster) (pool-lock taskmaster)
                                    :timeout +sweep-interval-seconds+)))))))

(defun worker-thread-name (taskmaster)
  (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster)))
    (format nil "hunchentoot-recycling-worker ~A:~A"
            (or (hunchentoot:acceptor-address acceptor) "*")
            (hunchentoot:acceptor-port acceptor))))

(defun make-worker-thread (taskmaster)
  (let ((worker (make-worker taskmaster)))
    (with-pool-state-change (taskmaster)
      (decf (pending-thread-count taskmaster))
      (push worker (pool-workers taskmaster))
      (incf (pool-thread-count taskmaster))
      (incf (threads-created taskmaster))
      (setf (peak-thread-count taskmaster)
            (max (peak-thread-count taskmaster) (pool-thread-count taskmaster))))
    (handler-case
        (setf (worker-thread worker)
              (hunchentoot:start-thread taskmaster
                                        (lambda () (run-worker taskmaster worker))
                                        :name (worker-thread-name taskmaster)))
      (error (condition)
        (with-pool-state-change (taskmaster)
          (setf (pool-workers taskmaster) (delete worker (pool-workers taskmaster)))
          (decf (pool-thread-count taskmaster))
          (notify-pool-changed taskmaster))
        (hunchentoot:acceptor-log-message (hunchentoot:taskmaster-acceptor taskmaster)
                                          :error "could not make a worker thread: ~A" condition)
        (sleep 0.1)))))

(defun wait-for-queue-room (taskmaster)
  "While some worker is answering a request, and so may be about to let go
of its connection, wait up to +QUEUE-ROOM-GRACE-MILLISECONDS+ for room in
the queue.  Call with POOL-LOCK held.  True when there is room."
  (loop with deadline = (+ (get-internal-real-time)
                           (milliseconds->internal-units +queue-room-grace-milliseconds+))
        until (queue-has-room-p taskmaster)
        do (let ((left (- deadline (get-internal-real-time))))
             (when (or (<= left 0)
                       (shutting-down-p taskmaster)
                       (notany (lambda (worker) (member (worker-state worker) '(:in-request :connected)))
                               (pool-workers taskmaster)))
               (return nil))
             (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster)
                                :timeout (/ left internal-time-units-per-second)))
        finally (return t)))

(defun note-overflow-accepted (taskmaster socket)
  "End an overflow round that accepted SOCKET (or NIL).  Returns :QUEUED,
:REJECT, or NIL."
  (with-pool-lock (taskmaster)
    (when socket
      (wait-for-queue-room taskmaster))
    (setf (overflow-accepting-p taskmaster) nil)
    (multiple-value-prog1
        (cond ((null socket) nil)
              ((queue-has-room-p taskmaster)
               (setf (queued-connections taskmaster)
                     (nconc (queued-connections taskmaster)
                            (list (cons socket (get-internal-real-time)))))
               (incf (connections-accepted taskmaster))
               :queued)
              (t
               (incf (connections-rejected taskmaster))
               :reject))
      (notify-pool-changed taskmaster))))

(defun reclaim-idle-connection (taskmaster)
  "Close one kept-alive connection that has waited long for its next request,
so that its worker serves a queued connection."
  (dolist (worker (claim-workers-to-cut
                   taskmaster '(:idle) :limit 1
                   :idle-for (milliseconds->internal-units +reclaim-idle-after-milliseconds+)))
    (cut-connection worker '(:idle))))

(defun accept-for-saturated-pool (taskmaster)
  "One overflow round: accept a connection the busy workers cannot, then
queue it or answer it 503; while connections wait in the queue, reclaim an
idle kept-alive connection for them."
  (let ((socket (and (wait-until-readable (taskmaster-listen-socket taskmaster)
                                          +overflow-poll-milliseconds+)
                     (accept-connection taskmaster))))
    (when (eq (note-overflow-accepted taskmaster socket) :reject)
      (hunchentoot:too-many-taskmaster-requests taskmaster socket)
      (reject-connection socket))
    (when (queued-connections taskmaster)
      (reclaim-idle-connection taskmaster))))

(defun run-thread-maker (taskmaster)
  (loop
    (ecase (next-maker-task taskmaster)
      (:exit (return))
      (:make-thread (make-worker-thread taskmaster))
      (:overflow (accept-for-saturated-pool taskmaster))
      (:sweep (close-expired-connections (taskmaster-readiness-set taskmaster))))))

(defmethod hunchentoot:too-many-taskmaster-requests ((taskmaster recycling-taskmaster) socket)
  (declare (ignore socket))
  ;; Under overload this runs for every refused connection; one line a
  ;; second says as much without flooding the log.
  (let ((now (get-universal-time)))
    (when (/= now (last-rejection-log-time taskmaster))
      (setf (last-rejection-log-time taskmaster) now)
      (hunchentoot:acceptor-log-message
       (hunchentoot:taskmaster-acceptor taskmaster) :warning
       "All ~D worker threads busy and ~D connections queued: answering 503 (~D so far)"
       (pool-thread-count taskmaster) (length (queued-connections taskmaster))
       (connections-rejected taskmaster)))))

;;; Starting and stopping.

(defun signal-corrupted (taskmaster description)
  "Signal RECYCLING-TASKMASTER-CORRUPTED-ERROR.  Its restart abandons the
acceptor and leaves the START or STOP under way, whose :AROUND method on
PARALLEL-ACCEPTOR catches ACCEPTOR-ABANDONED."
  (restart-case (error 'recycling-taskmaster-corrupted-error
                       :taskmaster taskmaster :description description)
    (abandon-acceptor ()
      :report "Abandon the acceptor: end every worker by force and close its socket."
      (abandon-acceptor (hunchentoot:taskmaster-acceptor taskmaster))
      (throw 'acceptor-abandoned nil))))

(defun reset-pool (taskmaster)
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) nil
          (soft-stop-p taskmaster) nil
          (overflow-accepting-p taskmaster) nil
          (queued-connections taskmaster) '()
          (pending-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))))

(defun standby-threads-started-p (taskmaster)
  "True when the standby workers exist and each has begun taking connections.
Not that they all accept: under load some already serve."
  (and (zerop (pending-thread-count taskmaster))
       (>= (pool-thread-count taskmaster) (taskmaster-standby-thread-count taskmaster))
       (notany (lambda (worker) (eq (worker-state worker) :starting))
               (pool-workers taskmaster))))

(defun wait-for-standby-threads (taskmaster)
  (let ((deadline (+ (get-internal-real-time) (* 10 internal-time-units-per-second))))
    (with-pool-lock (taskmaster)
      (loop until (standby-threads-started-p taskmaster)
            do (when (>= (get-internal-real-time) deadline)
                 (return nil))
               (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster) :timeout 0.1)
            finally (return t)))))

(defmethod hunchentoot:execute-acceptor ((taskmaster recycling-taskmaster))
  (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster)))
    (unless (typep acceptor 'parallel-acceptor)
      ;; START has already listened; leave the port free for a retry.
      (ignore-errors (usocket:socket-close (acceptor-listen-socket acceptor)))
      (setf (acceptor-listen-socket acceptor) nil)
      (error 'acceptor-not-parallel-error :acceptor acceptor))
    (when (pool-workers taskmaster)
      (signal-corrupted taskmaster (format nil "~D worker threads from an earlier run are still alive."
                                           (length (pool-workers taskmaster)))))
    (reset-pool taskmaster)
    (if (eq (acceptor-connection-engine acceptor) :readiness-set)
        (setf (taskmaster-readiness-set taskmaster)
              (make-readiness-set (acceptor-listen-socket acceptor) (connection-counters taskmaster)
                                  :header-timeout (acceptor-header-timeout acceptor)
                                  :keep-alive-timeout (acceptor-keep-alive-timeout acceptor)
                                  :max-header-bytes (acceptor-max-header-bytes acceptor)))
        (set-accept-timeout (acceptor-listen-socket acceptor) (taskmaster-thread-idle-timeout taskmaster)))
    (setf (thread-maker taskmaster)
          (hunchentoot:start-thread taskmaster (lambda () (run-thread-maker taskmaster))
                                    :name (format nil "hunchentoot-recycling-thread-maker ~A:~A"
                                                  (or (hunchentoot:acceptor-address acceptor) "*")
                                                  (hunchentoot:acceptor-port acceptor))))
    (with-pool-lock (taskmaster) (notify-thread-maker taskmaster))
    (unless (wait-for-standby-threads taskmaster)
      (signal-corrupted taskmaster "the standby workers did not start within 10 seconds."))
    taskmaster))

(defun retire-readiness-set (taskmaster)
  "Close TASKMASTER's readiness set; its counts stay in CONNECTION-COUNTERS."
  (destroy-readiness-set (with-pool-state-change (taskmaster)
                           (shiftf (taskmaster-readiness-set taskmaster) nil))))

(defun begin-shutdown (taskmaster)
  (with-pool-state-change (taskmaster)
    (setf (shutting-down-p taskmaster) t)
    (notify-thread-maker taskmaster)
    (notify-pool-changed taskmaster)))

(defun wait-for-requests-in-flight (taskmaster)
  (with-pool-lock (taskmaster)
    (loop while (plusp (in-request-count taskmaster))
          do (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster) :timeout 0.1))))

(defun take-queued-connections (taskmaster)
  (with-pool-state-change (taskmaster)
    (mapcar #'car (shiftf (queued-connections taskmaster) '()))))

(defun wait-for-pool-to-empty (taskmaster seconds)
  "True when every worker has ended within SECONDS."
  (let ((deadline (+ (get-internal-real-time) (* seconds internal-time-units-per-second))))
    (with-pool-lock (taskmaster)
      (loop while (pool-workers taskmaster)
            do (when (>= (get-internal-real-time) deadline)
                 (return nil))
               (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster) :timeout 0.1)
            finally (return t)))))

(defun connection-states-to-cut (taskmaster)
  "The worker states HUNCHENTOOT:STOP ends the connection of: those waiting on
a client, and, when the stop is hard, those inside a request."
  (append (if (taskmaster-readiness-set taskmaster) '(:handshaking) '(:reading :idle))
          (unless (soft-stop-p taskmaster) '(:in-request))))

(defmethod hunchentoot:shutdown ((taskmaster recycling-taskmaster))
  "End the pool: stop accepting, let in-flight requests finish when the stop
is soft (cut them when it is hard), close idle and parked connections,
answer queued connections 503, and join every thread."
  (let ((threads (with-pool-lock (taskmaster)
                   (remove nil (mapcar #'worker-thread (pool-workers taskmaster)))))
        (set (taskmaster-readiness-set taskmaster)))
    (begin-shutdown taskmaster)
    (cond (set (wake-all-waiters set)
               (close-parked-connections set))
          (t (wake-accepting-threads (taskmaster-listen-socket taskmaster))))
    (when (soft-stop-p taskmaster)
      (wait-for-requests-in-flight taskmaster))
    (let ((states (connection-states-to-cut taskmaster)))
      (dolist (worker (claim-workers-to-cut taskmaster states))
        (cut-connection worker states)))
    (mapc #'reject-connection (take-queued-connections taskmaster))
    (unless (wait-for-pool-to-empty taskmaster (taskmaster-stop-timeout taskmaster))
      (signal-corrupted taskmaster (format nil "~D worker threads did not end within ~A seconds of STOP."
                                           (length (pool-workers taskmaster))
                                           (taskmaster-stop-timeout taskmaster))))
    (dolist (thread threads)
      (join-thread-within thread (taskmaster-stop-timeout taskmaster)))
    (when (thread-maker taskmaster)
      (join-thread-within (shiftf (thread-maker taskmaster) nil) (taskmaster-stop-timeout taskmaster)))
    (when set
      (close-parked-connections set)
      (retire-readiness-set taskmaster))
    taskmaster))

;;; Observing the pool.

(defmethod hunchentoot:taskmaster-thread-count ((taskmaster recycling-taskmaster))
  (pool-thread-count taskmaster))

(defgeneric taskmaster-statistics (taskmaster)
  (:documentation "A fresh plist describing TASKMASTER's pool (TASKMASTER may
also be a PARALLEL-ACCEPTOR, meaning its taskmaster) now, cheap enough to
poll.  Keys: :THREADS (workers in the pool), :BUSY-THREADS (workers
holding a connection), :ACCEPTING-THREADS (workers waiting for a
connection: in accept(2), or in epoll_wait with the readiness-set engine),
:IN-REQUEST-THREADS, :QUEUED-CONNECTIONS (blocking engine: accepted while
the pool was saturated), :PARKED-CONNECTIONS (readiness-set engine:
connections waiting for bytes without a thread), :OPEN-CONNECTIONS
(readiness-set engine: parked or being served), and the totals since the
taskmaster was made :CONNECTIONS-ACCEPTED, :CONNECTIONS-REJECTED (answered
503), :REQUESTS-SERVED, :THREADS-CREATED, :THREADS-RETIRED, :PEAK-THREADS,
:KEEP-ALIVE-TIMEOUTS (kept-alive connections closed after
KEEP-ALIVE-TIMEOUT idle seconds), and one count per refused request head:
:BAD-REQUEST-REPLIES (400, malformed or ambiguous framing),
:HEADER-TIMEOUT-REPLIES (408), :LENGTH-REQUIRED-REPLIES (411, a chunked
body to an acceptor without input chunking), :URI-TOO-LONG-REPLIES (414),
:HEADER-TOO-LARGE-REPLIES (431) and :VERSION-NOT-SUPPORTED-REPLIES (505);
these are counted by the readiness-set engine only (the blocking engine
reads heads with Hunchentoot's reader).  The order of keys is unspecified.
The pool's counts are taken under its lock in one go; the connection counts
and :REQUESTS-SERVED may lag by the work finishing while they are read."))

(defmethod taskmaster-statistics ((taskmaster recycling-taskmaster))
  (with-pool-lock (taskmaster)
    (list* :threads (pool-thread-count taskmaster)
           :busy-threads (busy-thread-count taskmaster)
           :accepting-threads (waiting-thread-count taskmaster)
           :in-request-threads (in-request-count taskmaster)
           :queued-connections (length (queued-connections taskmaster))
           :connections-accepted (+ (connections-accepted taskmaster)
                                    (connection-counters-accepted (connection-counters taskmaster)))
           :connections-rejected (connections-rejected taskmaster)
           :requests-served (+ (retired-requests-served taskmaster)
                               (reduce #'+ (pool-workers taskmaster) :key #'worker-requests-served))
           :threads-created (threads-created taskmaster)
           :threads-retired (threads-retired taskmaster)
           :peak-threads (peak-thread-count taskmaster)
           (readiness-statistics (taskmaster-readiness-set taskmaster)
                                 (connection-counters taskmaster)))))

(defun busy-thread-count (taskmaster)
  (let ((set (taskmaster-readiness-set taskmaster)))
    (if set
        (max 0 (- (pool-thread-count taskmaster) (readiness-set-waiting-count set)))
        (busy-count taskmaster))))

(defun waiting-thread-count (taskmaster)
  (let ((set (taskmaster-readiness-set taskmaster)))
    (if set (readiness-set-waiting-count set) (accepting-count taskmaster))))
