;;;; When the pool grows.  A worker woken while no other waits asks for one
;;;; more (NOTE-WOKEN); the thread-making thread weighs the request here.
;;;; A resting worker (pool/worker.lisp) costs no thread to wake: while work
;;;; waits that no worker has taken and a handler has been running for a
;;;; millisecond or more, one is released at once, since that handler may
;;;; wait with the processors busy (one request per connection keeps them
;;;; busy with the clients and the kernel).  While handlers are quick, a
;;;; released worker would only take turns with the running ones and be
;;;; back at rest a moment later
;;;; (bench/profiles/2026-11-26-resting-release.txt), so it is released
;;;; only where a thread would be made: for idle processors.  A new thread
;;;; pays only when a processor is free to run it: when the processors are
;;;; all busy, the newcomer just takes turns with the workers there are,
;;;; and each thread added costs every request a share of the switching
;;;; between them (bench/profiles/2026-11-22-pool-growth.txt: a 0 ms
;;;; handler on 2 cores answered about a third more with the pool held at
;;;; its 8 standby workers than grown to 100).  Handlers that wait -- on a
;;;; timer, a client, a database -- leave processors idle, and then more
;;;; workers answer more.  So a thread is made while there is work no
;;;; worker has taken and the processors the process may use
;;;; (sys/processors.lisp: its affinity mask, its cgroup's quota) were idle for part of
;;;; the last moment, by at most the idle share of the pool's size until it
;;;; is measured again -- and the garbage collector took less than
;;;; +COLLECTION-SHARE-TO-HOLD+ of it: while it collects, every thread
;;;; stopped, the processors look idle, but a worker added would only
;;;; hold more of a heap already short (a thousand handlers building
;;;; megabytes each grew the pool to 68 threads and the heap to 90 %);
;;;; growth declines otherwise, and looks again at
;;;; growing intervals while no worker waits, since a pool whose every
;;;; worker blocks has nobody left to ask.  Until the pool grows, each
;;;; weighing is the last for an interval, which doubles up to
;;;; +LAST-GROWTH-WEIGHING-INTERVAL+: a worker asking in between is heard
;;;; at the next one, without waking the thread-making thread, which under
;;;; a load that keeps every waiting worker busy would otherwise weigh
;;;; hundreds of times a second, for nothing.  Where the processors' idle time
;;;; cannot be read, the pool grows whenever it is asked.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +first-growth-weighing-interval+ 1/1000
  "Seconds before growth is weighed again after the first weighing that did
not grow the pool.")

(defconstant +last-growth-weighing-interval+ 32/1000
  "The longest interval between two weighings of growth while the pool does
not grow: how late it may start growing when its handlers begin to block.
Under a load that keeps every waiting worker busy with quick handlers the
thread-making thread weighs at this rate, for nothing: at 0 ms and 100
kept-alive connections, 16 ms cost 0.0022-0.0024 futex calls a request,
32 ms 0.0014-0.0015 (bench/profiles/2026-11-26-growth-weighing.txt).")

(defconstant +idle-sample-seconds+ 1/20
  "The shortest stretch of time the processors' idle share is measured over:
the kernel counts it in ticks of 10 ms.")

(defconstant +idle-share-to-grow+ 15/100
  "The share of the processors' time that must have been idle for the pool
to grow.")

(defconstant +collection-share-to-hold+ 1/10
  "The share of the time the garbage collector may take, between two
readings of the idle share, for the pool to grow.")

(defstruct (idle-gauge (:constructor make-idle-gauge (limit &aux (ticks (make-processor-ticks limit)))))
  "The idle share of the processors LIMIT allows the process, measured by
the thread-making thread only."
  ;; Where their processor time is read (sys/processor-time.lisp).
  (ticks nil :type processor-ticks :read-only t)
  ;; Internal real time of the last reading, and its ticks.
  (read-at nil)
  (idle-ticks 0)
  (total-ticks 0)
  ;; GARBAGE-COLLECTION-TIME at the last reading, and whether the
  ;; collector took +COLLECTION-SHARE-TO-HOLD+ or more of the time since
  ;; the reading before.
  (collection-time (garbage-collection-time))
  (collecting-p nil)
  ;; Idle ticks over all ticks between the last two readings at least
  ;; +IDLE-SAMPLE-SECONDS+ apart; NIL when the time cannot be read.
  (idle-share nil)
  ;; Workers the pool may still add before the next reading.
  (growth-budget 0))

(defun close-idle-gauge (gauge)
  "Let go of what GAUGE reads the processors' time through."
  (close-processor-ticks (idle-gauge-ticks gauge)))

(defun refresh-idle-gauge (gauge thread-count)
  "Read the processors' ticks into GAUGE again when +IDLE-SAMPLE-SECONDS+
have passed since the last reading.  A fresh idle share of at least
+IDLE-SHARE-TO-GROW+ lets a pool of THREAD-COUNT workers add that share of
them until the next reading: the pool grows by what was idle, not without
bound while the share is measured again."
  (let ((now (get-internal-real-time))
        (read-at (idle-gauge-read-at gauge)))
    (when (or (null read-at)
              (>= (- now read-at) (seconds->internal-units +idle-sample-seconds+)))
      (multiple-value-bind (idle total) (read-processor-ticks (idle-gauge-ticks gauge))
        (let ((share (cond ((or (null idle) (zerop total)) nil)
                           ;; The first reading: the share since boot.
                           ((null read-at) (/ idle total))
                           ((> total (idle-gauge-total-ticks gauge))
                            (/ (- idle (idle-gauge-idle-ticks gauge)) (- total (idle-gauge-total-ticks gauge))))
                           (t (idle-gauge-idle-share gauge)))))
          (setf (idle-gauge-collecting-p gauge)
                (and read-at (>= (- (garbage-collection-time) (idle-gauge-collection-time gauge))
                                 (* +collection-share-to-hold+ (- now read-at))))
                (idle-gauge-idle-share gauge) share
                (idle-gauge-growth-budget gauge) (if (and share (>= share +idle-share-to-grow+)
                                                          (not (idle-gauge-collecting-p gauge)))
                                                     (max 1 (ceiling (* share thread-count)))
                                                     0)
                (idle-gauge-collection-time gauge) (garbage-collection-time)
                (idle-gauge-read-at gauge) now
                (idle-gauge-idle-ticks gauge) (or idle 0)
                (idle-gauge-total-ticks gauge) (or total 0)))))))

(defun refreshed-idle-gauge (taskmaster)
  "TASKMASTER's idle gauge, read again if its reading is old."
  (let ((gauge (or (pool-idle-gauge taskmaster)
                   (setf (pool-idle-gauge taskmaster) (make-idle-gauge (pool-processor-limit taskmaster))))))
    (refresh-idle-gauge gauge (pool-thread-count taskmaster))
    gauge))

(defun take-growth-budget (gauge)
  "True when the processors' idle time, as GAUGE read it, leaves room for
one more worker (or cannot be read), which is then counted against it."
  (cond ((null (idle-gauge-idle-share gauge)) t)
        ((plusp (idle-gauge-growth-budget gauge))
         (decf (idle-gauge-growth-budget gauge))
         t)))

(defun handler-waiting-p (taskmaster)
  "True when a worker has been inside its request for +LONG-REQUEST-SECONDS+
or more, as when its handler waits on a timer, a client or a database.
POOL-LOCK held; each worker's state and start are read as its own thread
last wrote them."
  (let ((now (monotonic-microseconds)))
    (some (lambda (worker)
            (and (eq (worker-state worker) :in-request)
                 (long-request-p (- now (worker-request-started worker)))))
          (pool-workers taskmaster))))

(defun growth-decision (taskmaster)
  "What to do about a request for one more worker: :DROP it when a worker
waits; :LATER when no work waits yet; :GROW when a worker rests while a
handler waits, or the processors' idle time leaves room for a worker,
unless the garbage collector took a large share of the time; else
:DECLINE."
  (cond ((plusp (waiting-worker-count taskmaster)) :drop)
        ((not (engine-work-waiting-p (taskmaster-engine taskmaster))) :later)
        (t (let ((gauge (refreshed-idle-gauge taskmaster)))
             (cond ((idle-gauge-collecting-p gauge) :decline)
                   ((with-pool-lock (taskmaster)
                      (and (plusp (unreleased-resting-count taskmaster))
                           (handler-waiting-p taskmaster)))
                    :grow)
                   ((take-growth-budget gauge) :grow)
                   (t :decline))))))

(defun drop-growth-request (taskmaster)
  "Forget the request for one more worker, weighed while a worker waited,
unless the waiting count has fallen to zero since: a worker woken as the
last waiting one asks only while no request is marked (NOTE-WOKEN), so a
request dropped after that worker looked would leave every worker busy or
resting, and the work ready in the engine untaken, until a handler ends.
The mark is cleared before the count is read, as the worker reads the mark
after its decrement: one of the two sees the other.  POOL-LOCK held.  True
when the request was dropped."
  (setf (growth-asked-p taskmaster) nil)
  (memory-barrier)
  (if (zerop (waiting-worker-count taskmaster))
      (progn (setf (growth-asked-p taskmaster) t) nil)
      t))

(defun weigh-growth (taskmaster)
  "Weigh the request for one more worker: ask for it; or drop the request,
or keep it, and weigh no other before an interval that doubles each time
the pool does not grow."
  (let ((decision (growth-decision taskmaster)))
    (with-pool-state-change (taskmaster)
      (flet ((next-weighing-in (seconds)
               (setf (growth-weighing-interval taskmaster) seconds
                     (next-growth-weighing taskmaster) (deadline-in seconds))))
        (if (eq decision :grow)
            (progn
              (setf (growth-asked-p taskmaster) nil)
              (next-weighing-in 0)
              (cond ((plusp (unreleased-resting-count taskmaster))
                     (release-resting-worker taskmaster))
                    ((pool-may-grow-p taskmaster)
                     (incf (pending-thread-count taskmaster)))))
            (progn
              (ecase decision
                (:drop (drop-growth-request taskmaster))
                (:decline (incf (growth-declined-count taskmaster)))
                (:later))
              (next-weighing-in (min +last-growth-weighing-interval+
                                     (max +first-growth-weighing-interval+
                                          (* 2 (growth-weighing-interval taskmaster)))))))))))

(defun growth-wakeup-time (taskmaster now)
  "The internal real time at which the thread-making thread looks at growth
next: when a worker has asked for one more worker or the next weighing is
still to come, the time of that weighing; else NIL.  POOL-LOCK held."
  (and (or (growth-asked-p taskmaster) (growth-weighing-scheduled-p taskmaster now))
       (next-growth-weighing taskmaster)))
