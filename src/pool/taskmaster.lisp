;;;; RECYCLING-TASKMASTER: a pool of worker threads that serve whatever the
;;;; acceptor's connection engine has ready, grown by one thread-making
;;;; thread and shrunk by idle workers retiring themselves.  The pool knows
;;;; its workers and counts them; what a worker does between two looks at
;;;; the pool is the engine's (engine/protocol.lisp), and the pool never
;;;; asks which engine it has.
;;;;
;;;; Locking discipline.
;;;; - POOL-LOCK guards the worker list and the pool's counts.  Each change
;;;;   of pool state is one small function (pool/worker.lisp) that takes
;;;;   the lock once, with interrupts deferred so that
;;;;   BT:DESTROY-THREAD (ABANDON-ACCEPTOR only) never leaves half a change.
;;;;   The lock is never held across I/O, thread creation or joining.
;;;; - ENGINE and SOFT-STOP-P are written only while no worker runs (START
;;;;   before the first worker is made, STOP before it wakes them), so they
;;;;   are read without the lock.
;;;; - The count of waiting workers changes twice per request: it is an
;;;;   atomic word in GAUGES, not locked.  A worker joins the waiters by a
;;;;   compare-and-swap that keeps them at most MAX-WAITING-THREAD-COUNT;
;;;;   only workers back from long requests (up to a multiple of it on
;;;;   kept-alive connections), or released from rest by growth, join past
;;;;   it.  A worker that leaves them to rest or retire does so by a
;;;;   compare-and-swap too, which never takes the count to zero: only a
;;;;   worker woken to serve does, and then asks for growth (NOTE-WOKEN),
;;;;   or one leaving because the pool stops.
;;;; - Resting workers (pool/worker.lisp) wait on RESTING-WAKEUP under
;;;;   POOL-LOCK; their counts are the lock's.
;;;; - GROWTH-ASKED-P is written under POOL-LOCK, but a worker that has just
;;;;   left the waiting reads it without the lock, after its atomic
;;;;   decrement of the waiting count (NOTE-WOKEN).  The thread-making
;;;;   thread, dropping a request because a worker waits, clears it before
;;;;   it reads that count again (DROP-GROWTH-REQUEST): either the worker
;;;;   sees no request marked and asks, or the thread sees nobody waiting
;;;;   and keeps the request.
;;;; - A worker's STATE is written by its own thread only.  Before each
;;;;   request it writes its state, then, after a memory barrier, reads
;;;;   SHUTTING-DOWN-P; STOP writes SHUTTING-DOWN-P under the lock and reads
;;;;   states after taking it.  So either the worker sees the stop, or the
;;;;   stop sees the worker in its request.
;;;; - No thread is ever interrupted.  STOP wakes a worker that waits on a
;;;;   client by shutting that client's socket down (ENGINE-CUT-CONNECTION),
;;;;   under the worker's CONNECTION-LOCK, which the worker also takes to
;;;;   let go of the connection before its descriptor is closed: a shutdown
;;;;   never reaches a descriptor that was closed and perhaps reused.

(in-package #:hunchentoot-recycling-taskmaster)

(defun default-max-waiting-thread-count (processor-count)
  "One more than PROCESSOR-COUNT, the processors the process may use, and 2
at least: a waiting worker for
each processor, and one for the processor whose worker has just entered a
handler; any more, and a connection's bytes often wake a thread that was
asleep, when a worker already running would have taken them a moment later
(bench/profiles/2026-11-24-waiting-workers.txt)."
  (max 2 (1+ processor-count)))

(defvar *default-standby-thread-count* 8
  "The STANDBY-THREAD-COUNT of a RECYCLING-TASKMASTER made without one: how
many workers wait for connections when there is no load.")

(defgeneric taskmaster-standby-thread-count (taskmaster)
  (:documentation "How many workers TASKMASTER keeps waiting for connections
when there is no load."))

(defgeneric taskmaster-max-waiting-thread-count (taskmaster)
  (:documentation "The most workers of TASKMASTER that wait on the engine for
something to serve at once; other idle workers rest in the pool until
growth needs them."))

(defgeneric taskmaster-thread-idle-timeout (taskmaster)
  (:documentation "Seconds a worker of TASKMASTER waits for something to
serve before it looks at the pool; a surplus worker that waited this long
retires."))

(defgeneric taskmaster-stop-timeout (taskmaster)
  (:documentation "Seconds HUNCHENTOOT:STOP may take for TASKMASTER's
workers to finish and end, waits for requests in flight included, before it
signals RECYCLING-TASKMASTER-CORRUPTED-ERROR."))

(defgeneric taskmaster-worker-scheduling-policy (taskmaster)
  (:documentation "The kernel's scheduling policy TASKMASTER's workers take:
:BATCH (SCHED_BATCH, sched(7)), :OTHER (SCHED_OTHER), or NIL for the one
they inherit."))

(defstruct (pool-gauges (:constructor make-pool-gauges ()))
  "The pool's counts that change on every request, kept as atomic words."
  ;; Workers in (or entering) the engine's wait for something to serve.
  (waiting 0 :type word))

(defclass recycling-taskmaster (hunchentoot:multi-threaded-taskmaster)
  ((standby-thread-count
    :initarg :standby-thread-count
    :reader taskmaster-standby-thread-count
    :documentation "How many workers wait for connections when there is no
load: made by HUNCHENTOOT:START and kept when idle workers retire.")
   (max-thread-count
    :initarg :max-thread-count
    :reader hunchentoot:taskmaster-max-thread-count
    :documentation "The most workers the pool may hold, or NIL for no limit.
When every one of them is busy, connections wait, costing no thread, until
a worker is free.")
   (max-waiting-thread-count
    :initarg :max-waiting-thread-count
    :reader taskmaster-max-waiting-thread-count
    :documentation "The most workers that wait on the engine at once.  Each
waiting worker is a thread the kernel may wake for a connection's bytes
while another worker, already running, would take them a moment later:
beyond a few per processor, waking costs more than waiting.  Idle workers
past this count rest on a condition variable of the pool, and growth
(pool/growth.lisp) wakes one of them before it makes a thread.  A worker
whose last request took a millisecond or more waits on the engine whatever
the count: handlers that wait need workers in circulation.  One back from a
new connection waits only while fewer than this count less one wait
(JOIN-WAITING).  Unless given, one more than the processors the process may
use (DEFAULT-MAX-WAITING-THREAD-COUNT).")
   (max-accept-count
    :initarg :max-accept-count
    :reader hunchentoot:taskmaster-max-accept-count
    :documentation "Taken for compatibility with Hunchentoot's taskmaster, whose
initargs a user may pass unchanged; it bounds nothing here, since a waiting
connection holds no thread.")
   (thread-idle-timeout
    :initarg :thread-idle-timeout
    :reader taskmaster-thread-idle-timeout
    :documentation "Seconds a worker waits for something to serve before it
looks at the pool; a surplus worker that waited this long retires.")
   (stop-timeout
    :initarg :stop-timeout
    :reader taskmaster-stop-timeout
    :documentation "Seconds HUNCHENTOOT:STOP may take for the workers to
finish and end, before it calls the pool corrupted.")
   (worker-scheduling-policy
    :initarg :worker-scheduling-policy
    :reader taskmaster-worker-scheduling-policy
    :documentation "The scheduling policy each worker gives its own thread as
it starts, or NIL, the default, for the one it inherits (the kernel's
default, SCHED_OTHER, unless the process was started otherwise, as by
chrt(1)).  Under :OTHER a worker woken -- its handler's sleep or database
reply over, a connection's bytes come -- may preempt the thread running;
under :BATCH it waits until that thread blocks or its time slice ends, and
so does a worker woken for the listening socket: :BATCH suits a pool whose
connections are few and long-lived, as behind a proxy that keeps its
upstream connections alive (docs/operations.md).  Threads a handler starts
inherit its worker's policy.")
   ;; bench/profiles/2026-11-25-batch-scheduling.txt: :BATCH answered a
   ;; third more kept-alive requests to 1 ms handlers, but when a thousand
   ;; clients connected at once p99 rose from 52 ms to 405 ms.
   (engine
    :initform nil :accessor taskmaster-engine
    :documentation "The CONNECTION-ENGINE the workers serve, made by the first
HUNCHENTOOT:START and kept, with what it counted, from run to run.")
   (pool-lock :initform (bt:make-lock "recycling-taskmaster-pool") :reader pool-lock)
   (pool-changed
    :initform (bt:make-condition-variable) :reader pool-changed
    :documentation "Notified when a worker begins to wait for the first time,
finishes a request while the pool stops, or ends.")
   (maker-wakeup
    :initform (bt:make-condition-variable) :reader maker-wakeup
    :documentation "Notified when the thread-making thread has work: a thread
to make, or shutdown.")
   (resting-wakeup
    :initform (bt:make-condition-variable) :reader resting-wakeup
    :documentation "Notified when growth releases a resting worker, and
broadcast when the pool stops.")
   (resting-count :initform 0 :accessor resting-count
                  :documentation "Workers resting in the pool, off the engine, released ones included.")
   (released-count :initform 0 :accessor released-count
                   :documentation "Resting workers growth has released that have
not yet woken to take their place among the waiting.")
   (workers :initform '() :accessor pool-workers
            :documentation "Every live worker thread's record, retiring ones included.")
   (thread-maker :initform nil :accessor thread-maker
                 :documentation "The one thread that makes worker threads and runs the
engine's periodic maintenance.")
   (thread-count :initform 0 :accessor pool-thread-count
                 :documentation "Workers in the pool, not counting those retiring.")
   (pending-thread-count :initform 0 :accessor pending-thread-count
                         :documentation "Workers asked of the thread-making thread, not yet made.")
   (growth-asked-p :initform nil :accessor growth-asked-p
                   :documentation "True while a worker's request for one more
worker waits for the thread-making thread to weigh it (pool/growth.lisp).")
   (next-growth-weighing :initform 0 :accessor next-growth-weighing
                         :documentation "The internal real time before which
the thread-making thread does not weigh growth again.")
   (growth-weighing-interval :initform 0 :accessor growth-weighing-interval
                             :documentation "Seconds from one weighing of growth
to the next: none after the pool grew, doubling while growth is declined.")
   (processor-limit :initform (processor-limit) :reader pool-processor-limit
                    :documentation "The processors the process may use, read when the
taskmaster is made (sys/processors.lisp): they size the waiting workers
and bound growth.")
   (idle-gauge :initform nil :accessor pool-idle-gauge
               :documentation "The IDLE-GAUGE growth is weighed by, made at the
first weighing; the thread-making thread's only.")
   (growth-declined-count :initform 0 :accessor growth-declined-count
                          :documentation "Times, ever, that the pool was asked to
grow while every processor already had a worker running, and did not.")
   (gauges :initform (make-pool-gauges) :reader pool-gauges)
   (shutting-down-p :initform nil :accessor shutting-down-p
                    :documentation "True from the moment HUNCHENTOOT:STOP begins until the next START.")
   (soft-stop-p :initform nil :accessor soft-stop-p
                :documentation "True when the current HUNCHENTOOT:STOP is soft.")
   (threads-created :initform 0 :accessor threads-created
                    :documentation "Worker threads made, ever.")
   (threads-retired :initform 0 :accessor threads-retired
                    :documentation "Worker threads that ended because they were surplus, ever.")
   (peak-thread-count :initform 0 :accessor peak-thread-count
                      :documentation "The most workers the pool has held at once.")
   (retired-requests-served :initform 0 :accessor retired-requests-served
                            :documentation "Requests served by workers that have ended."))
  (:default-initargs
   :standby-thread-count *default-standby-thread-count*
   :max-thread-count (default-max-thread-count)
   :max-accept-count (default-max-accept-count)
   :thread-idle-timeout 1
   :stop-timeout 10
   :worker-scheduling-policy nil)
  (:documentation "A taskmaster whose pooled worker threads all wait on the
acceptor's connection engine (by default one epoll set holding the listening
socket and every connection waiting for bytes) and serve whatever is ready:
no listener thread hands sockets over, and a connection holds a thread only
while a worker reads what has arrived or a handler runs.  The pool starts
with STANDBY-THREAD-COUNT workers; when the last waiting worker is woken,
the one thread-making thread adds one, up to MAX-THREAD-COUNT, if work is
waiting and the processors have idle time (handlers wait on timers,
clients, databases): workers that would only take turns on busy
processors are not made.  At most MAX-WAITING-THREAD-COUNT workers wait on
the engine at once; other idle workers rest, and growth wakes them before
it makes threads.  Surplus workers retire after THREAD-IDLE-TIMEOUT
seconds without work.  Needs a PARALLEL-ACCEPTOR."))

(defun check-count (initarg value &key (minimum 0) (null-allowed nil))
  (unless (or (and null-allowed (null value))
              (and (integerp value) (<= minimum value)))
    (error 'invalid-taskmaster-configuration
           :initarg initarg :value value
           :reason (format nil "must be an integer of at least ~D~:[~; or NIL~]"
                           minimum null-allowed))))

(defmethod initialize-instance :after ((taskmaster recycling-taskmaster)
                                       &key (max-waiting-thread-count nil max-waiting-thread-count-p))
  (declare (ignore max-waiting-thread-count))
  (unless max-waiting-thread-count-p
    (setf (slot-value taskmaster 'max-waiting-thread-count)
          (default-max-waiting-thread-count (processor-limit-count (pool-processor-limit taskmaster)))))
  (let ((standby (taskmaster-standby-thread-count taskmaster))
        (max-threads (hunchentoot:taskmaster-max-thread-count taskmaster)))
    ;; One standby worker at least: growth starts when a waiting worker is
    ;; woken, so a pool of none would never start.
    (check-count :standby-thread-count standby :minimum 1)
    (check-count :max-thread-count max-threads :minimum 1 :null-allowed t)
    (check-count :max-waiting-thread-count (taskmaster-max-waiting-thread-count taskmaster) :minimum 1)
    (check-count :max-accept-count (hunchentoot:taskmaster-max-accept-count taskmaster)
                 :minimum 1 :null-allowed t)
    (loop for (initarg seconds) in `((:thread-idle-timeout ,(taskmaster-thread-idle-timeout taskmaster))
                                     (:stop-timeout ,(taskmaster-stop-timeout taskmaster)))
          unless (and (realp seconds) (plusp seconds))
            do (error 'invalid-taskmaster-configuration
                      :initarg initarg :value seconds
                      :reason "must be a positive number of seconds"))
    (unless (member (taskmaster-worker-scheduling-policy taskmaster) '(nil :batch :other))
      (error 'invalid-taskmaster-configuration
             :initarg :worker-scheduling-policy :value (taskmaster-worker-scheduling-policy taskmaster)
             :reason "must be :BATCH, :OTHER or NIL"))
    (when (and max-threads (< max-threads standby))
      (error 'invalid-taskmaster-configuration
             :initarg :standby-thread-count :value standby
             :reason (format nil "is above :MAX-THREAD-COUNT ~D" max-threads)))))

(defun recycling-taskmaster-of (acceptor)
  "ACCEPTOR's taskmaster when it is a RECYCLING-TASKMASTER, else NIL."
  (let ((taskmaster (acceptor-taskmaster acceptor)))
    (and (typep taskmaster 'recycling-taskmaster) taskmaster)))

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

(defun taskmaster-acceptor-name (taskmaster)
  "ADDRESS:PORT of TASKMASTER's acceptor, for thread names."
  (let ((acceptor (hunchentoot:taskmaster-acceptor taskmaster)))
    (format nil "~A:~A" (or (hunchentoot:acceptor-address acceptor) "*")
            (hunchentoot:acceptor-port acceptor))))

(defun log-safely (acceptor level format-control &rest format-arguments)
  "ACCEPTOR-LOG-MESSAGE, except that a failure to log is dropped: Hunchentoot
opens a log file for every message, which fails when the process is out of
descriptors, and a worker must not die of a message it cannot write."
  (handler-case (apply #'hunchentoot:acceptor-log-message acceptor level format-control format-arguments)
    (error () nil)))

(defun seconds->internal-units (seconds)
  (round (* seconds internal-time-units-per-second)))

(defun deadline-in (seconds)
  "The internal real time SECONDS from now."
  (+ (get-internal-real-time) (seconds->internal-units seconds)))

(defun seconds-until (deadline)
  "Seconds from now until DEADLINE (internal real time), never negative: a
single float, which SBCL keeps in a register where a ratio is consed each
time a worker rests."
  (max 0f0 (/ (float (- deadline (get-internal-real-time)) 0f0) internal-time-units-per-second)))

(defun wait-for-pool (taskmaster predicate deadline)
  "Wait on POOL-CHANGED, holding POOL-LOCK, until PREDICATE is true or
DEADLINE (internal real time) passes.  True when PREDICATE is."
  (with-pool-lock (taskmaster)
    (loop until (funcall predicate)
          do (when (>= (get-internal-real-time) deadline)
               (return nil))
             (bt:condition-wait (pool-changed taskmaster) (pool-lock taskmaster)
                                :timeout (seconds-until deadline))
          finally (return t))))

(defun unreleased-resting-count (taskmaster)
  "Resting workers growth may still release.  POOL-LOCK held."
  (- (resting-count taskmaster) (released-count taskmaster)))

(defun pool-may-grow-p (taskmaster)
  "True when one more worker may be asked for: a resting one, or a new
thread below MAX-THREAD-COUNT.  POOL-LOCK held."
  (let ((max-threads (hunchentoot:taskmaster-max-thread-count taskmaster)))
    (and (not (shutting-down-p taskmaster))
         (or (plusp (unreleased-resting-count taskmaster))
             (null max-threads)
             (< (+ (pool-thread-count taskmaster) (pending-thread-count taskmaster))
                max-threads)))))

(defun growth-weighing-scheduled-p (taskmaster now)
  "True when the thread-making thread weighs growth at a time after NOW
(internal real time) if a worker has asked by then: a worker that asks
before that time need not wake it.  POOL-LOCK held."
  (> (next-growth-weighing taskmaster) now))

(defun waiting-worker-count (taskmaster)
  (pool-gauges-waiting (pool-gauges taskmaster)))

(defmethod acceptor-http2-max-running-streams ((acceptor parallel-acceptor))
  ;; The default: a share of the pool, so that one HTTP/2 client cannot take it.
  (or (slot-value acceptor 'http2-max-running-streams)
      (let* ((taskmaster (acceptor-taskmaster acceptor))
             (max-threads (and (typep taskmaster 'recycling-taskmaster)
                               (hunchentoot:taskmaster-max-thread-count taskmaster))))
        (if max-threads (max 1 (floor max-threads 4)) 16))))
