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

(defconstant +processor-ticks-octets+ 512
  "Room for the first line of /proc/stat: \"cpu\" and ten counts of ticks.")

(defun parse-processor-ticks (buffer end)
  "The ticks idle (idle and iowait) and the ticks in all (steal included,
guest time being counted in user time already) of the first line of
/proc/stat, in BUFFER below END; NIL when it is not such a line."
  (let* ((line-end (or (position 10 buffer :end end) end))
         (line (map 'string #'code-char (subseq buffer 0 line-end))))
    (when (and (> (length line) 4) (string= "cpu " line :end2 4))
      (let ((ticks (loop with position = 4
                         repeat 8
                         collect (multiple-value-bind (number number-end)
                                     (parse-integer line :start position :junk-allowed t)
                                   (setf position number-end)
                                   number))))
        (when (every #'integerp ticks)
          (values (+ (nth 3 ticks) (nth 4 ticks))
                  (reduce #'+ ticks)))))))

(defstruct (idle-gauge (:constructor make-idle-gauge ()))
  "The processors' idle share, measured by the thread-making thread only."
  ;; A descriptor open on /proc/stat, read again from its start at each
  ;; reading (one pread(2), where opening, reading and closing the file
  ;; took five system calls), or NIL while it could not be opened.
  (stat-fd nil)
  (buffer (make-array +processor-ticks-octets+ :element-type '(unsigned-byte 8)) :read-only t)
  ;; Internal real time of the last reading, and its ticks.
  (read-at nil)
  (idle-ticks 0)
  (total-ticks 0)
  ;; Idle ticks over all ticks between the last two readings at least
  ;; +IDLE-SAMPLE-SECONDS+ apart; NIL when /proc/stat cannot be read.
  (idle-share nil)
  ;; Workers the pool may still add before the next reading.
  (growth-budget 0))

(defun read-processor-ticks (gauge)
  "The machine's processor time now, as PARSE-PROCESSOR-TICKS gives it, read
through GAUGE's descriptor on /proc/stat (opened first if need be), or NIL
when it cannot be read."
  (let* ((fd (or (idle-gauge-stat-fd gauge)
                 (setf (idle-gauge-stat-fd gauge) (values (open-regular-file "/proc/stat")))))
         (buffer (idle-gauge-buffer gauge))
         (count (and fd (read-file-octets fd buffer 0))))
    (and count (parse-processor-ticks buffer count))))

(defun close-idle-gauge (gauge)
  "Close GAUGE's descriptor on /proc/stat, if open."
  (let ((fd (shiftf (idle-gauge-stat-fd gauge) nil)))
    (when fd
      (close-fd fd))))

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
      (multiple-value-bind (idle total) (read-processor-ticks gauge)
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
