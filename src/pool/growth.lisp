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
;;;; worker has taken and the machine's processors were idle for part of
;;;; the last moment, by at most the idle share of the pool's size until it
;;;; is measured again; growth declines otherwise, and looks again at
;;;; growing intervals while no worker waits, since a pool whose every
;;;; worker blocks has nobody left to ask.  Where the processors' idle time
;;;; cannot be read, the pool grows whenever it is asked.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +first-growth-weighing-interval+ 1/1000
  "Seconds before growth is weighed again after it was first declined.")

(defconstant +last-growth-weighing-interval+ 16/1000
  "The longest interval between two weighings of growth while it is
declined: how late the pool may start growing when its handlers begin to
block.")

(defconstant +idle-sample-seconds+ 1/20
  "The shortest stretch of time the processors' idle share is measured over:
the kernel counts it in ticks of 10 ms.")

(defconstant +idle-share-to-grow+ 15/100
  "The share of the processors' time that must have been idle for the pool
to grow.")

(defun read-processor-ticks ()
  "The machine's processor time, from the first line of /proc/stat: ticks
idle (idle and iowait) and ticks in all (steal included, guest time being
counted in user time already), or NIL when it cannot be read."
  (ignore-errors
   (with-open-file (stat "/proc/stat" :external-format :latin-1)
     (let ((line (read-line stat)))
       (when (and (> (length line) 4) (string= "cpu " line :end2 4))
         (let ((ticks (loop with position = 4
                            repeat 8
                            collect (multiple-value-bind (number end)
                                        (parse-integer line :start position :junk-allowed t)
                                      (setf position end)
                                      number))))
           (when (every #'integerp ticks)
             (values (+ (nth 3 ticks) (nth 4 ticks))
                     (reduce #'+ ticks)))))))))

(defstruct (idle-gauge (:constructor make-idle-gauge ()))
  "The processors' idle share, measured by the thread-making thread only."
  ;; Internal real time of the last reading, and its ticks.
  (read-at nil)
  (idle-ticks 0)
  (total-ticks 0)
  ;; Idle ticks over all ticks between the last two readings at least
  ;; +IDLE-SAMPLE-SECONDS+ apart; NIL when /proc/stat cannot be read.
  (idle-share nil)
  ;; Workers the pool may still add before the next reading.
  (growth-budget 0))

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
      (multiple-value-bind (idle total) (read-processor-ticks)
        (let ((share (cond ((or (null idle) (zerop total)) nil)
                           ;; The first reading: the share since boot.
                           ((null read-at) (/ idle total))
                           ((> total (idle-gauge-total-ticks gauge))
                            (/ (- idle (idle-gauge-idle-ticks gauge)) (- total (idle-gauge-total-ticks gauge))))
                           (t (idle-gauge-idle-share gauge)))))
          (setf (idle-gauge-idle-share gauge) share
                (idle-gauge-growth-budget gauge) (if (and share (>= share +idle-share-to-grow+))
                                                     (max 1 (ceiling (* share thread-count)))
                                                     0)
                (idle-gauge-read-at gauge) now
                (idle-gauge-idle-ticks gauge) (or idle 0)
                (idle-gauge-total-ticks gauge) (or total 0)))))))

(defun take-growth-budget (taskmaster)
  "True when the processors' idle time leaves room for one more worker (or
cannot be read), which is then counted against it."
  (let ((gauge (or (pool-idle-gauge taskmaster)
                   (setf (pool-idle-gauge taskmaster) (make-idle-gauge)))))
    (refresh-idle-gauge gauge (pool-thread-count taskmaster))
    (cond ((null (idle-gauge-idle-share gauge)) t)
          ((plusp (idle-gauge-growth-budget gauge))
           (decf (idle-gauge-growth-budget gauge))
           t))))

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
handler waits, or the processors' idle time leaves room for a worker; else
:DECLINE."
  (cond ((plusp (waiting-worker-count taskmaster)) :drop)
        ((not (engine-work-waiting-p (taskmaster-engine taskmaster))) :later)
        ((with-pool-lock (taskmaster)
           (and (plusp (unreleased-resting-count taskmaster))
                (handler-waiting-p taskmaster)))
         :grow)
        ((take-growth-budget taskmaster) :grow)
        (t :decline)))

(defun weigh-growth (taskmaster)
  "Weigh the request for one more worker: ask for it, drop the request, or
keep it to weigh again after an interval that doubles each time."
  (let ((decision (growth-decision taskmaster)))
    (with-pool-state-change (taskmaster)
      (flet ((next-weighing-in (seconds)
               (setf (growth-weighing-interval taskmaster) seconds
                     (next-growth-weighing taskmaster) (deadline-in seconds))))
        (ecase decision
          (:grow
           (setf (growth-asked-p taskmaster) nil)
           (next-weighing-in 0)
           (cond ((plusp (unreleased-resting-count taskmaster))
                  (release-resting-worker taskmaster))
                 ((pool-may-grow-p taskmaster)
                  (incf (pending-thread-count taskmaster)))))
          (:drop
           (setf (growth-asked-p taskmaster) nil))
          ((:decline :later)
           (when (eq decision :decline)
             (incf (growth-declined-count taskmaster)))
           (next-weighing-in (min +last-growth-weighing-interval+
                                  (max +first-growth-weighing-interval+
                                       (* 2 (growth-weighing-interval taskmaster)))))))))))

(defun growth-weighing-due (taskmaster)
  "The internal real time at which the thread-making thread weighs growth
next, or NIL when no worker asked for it.  POOL-LOCK held."
  (and (growth-asked-p taskmaster)
       (next-growth-weighing taskmaster)))
