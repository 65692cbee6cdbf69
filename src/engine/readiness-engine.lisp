;;;; The readiness engine's side of the engine protocol (protocol.lisp),
;;;; what the pool asks of it: answered by the readiness set (readiness/) and
;;;; the serving of its connections (serving/), the two floors it joins.

(in-package #:hunchentoot-recycling-taskmaster)

(defun log-refused-request (acceptor addresses status)
  "Write the access log entry of a request that the engine answered STATUS
by itself (a refused head, a request that waited too long for a worker)
on a connection with ADDRESSES, through HUNCHENTOOT:ACCEPTOR-LOG-ACCESS as
for any reply: the request object it reads has the client's address and
\"-\" for the method, the path and the protocol, which are not known or
not trusted.  A failure to log is dropped, as by LOG-SAFELY."
  (handler-case
      (destructuring-bind (&optional remote-addr remote-port local-addr local-port) addresses
        (let* ((hunchentoot:*acceptor* acceptor)
               (hunchentoot:*reply* (make-instance (engine-reply-class acceptor)))
               (hunchentoot:*session* nil)
               (hunchentoot:*request*
                 (make-instance (engine-request-class acceptor)
                                :acceptor acceptor
                                :local-addr local-addr :local-port local-port
                                :remote-addr remote-addr :remote-port remote-port
                                :headers-in '() :content-stream nil
                                :method :- :uri "-" :server-protocol :-)))
          (setf (hunchentoot:return-code*) status)
          (hunchentoot:acceptor-log-access acceptor :return-code status)))
    (error () nil)))

(defmethod engine-start ((engine readiness-engine))
  (let ((acceptor (engine-acceptor engine)))
    ;; First, as it is what may fail (a file that does not load): nothing
    ;; else has been made yet.
    (setf (engine-certificates engine) (make-acceptor-certificates acceptor (engine-certificate-counters engine)))
    (setf (engine-readiness-set engine)
          (make-readiness-set (acceptor-listen-socket acceptor) (engine-counters engine)
                              (let ((octets (acceptor-memory-budget acceptor)))
                                (if octets (make-memory-budget octets) (process-memory-budget)))
                              :header-timeout (acceptor-header-timeout acceptor)
                              :keep-alive-timeout (acceptor-keep-alive-timeout acceptor)
                              :queue-timeout (acceptor-queue-timeout acceptor)
                              :write-timeout (hunchentoot:acceptor-write-timeout acceptor)
                              :read-timeout (hunchentoot:acceptor-read-timeout acceptor)
                              :server-name (acceptor-server-name acceptor)
                              :stopping-test (engine-stopping-test engine)
                              :refusal-logger (lambda (connection status)
                                                (log-refused-request acceptor (connection-addresses connection)
                                                                     status)))
          (engine-object-constructors engine) (make-object-constructors acceptor)
          (engine-plain-streams-reset-p engine) (plain-streams-reset-p acceptor)
          (engine-sweep-buffer engine)
          (make-array (head-buffer-bytes acceptor) :element-type '(unsigned-byte 8)))))

(defun make-serving (engine worker)
  "The SERVING of WORKER, a worker of ENGINE, for ENGINE's current run."
  (let* ((acceptor (engine-acceptor engine))
         (set (engine-readiness-set engine))
         (server-name (acceptor-server-name acceptor))
         (keep-alive-value (format nil "timeout=~D" (floor (acceptor-keep-alive-timeout acceptor)))))
    (%make-serving :engine engine :worker worker :set set :budget (readiness-set-memory-budget set)
                   :reply-batch (make-reply-batch set)
                   :acceptor acceptor
                   :http2-p (acceptor-http2-p acceptor)
                   :access-log-json-p (eq (acceptor-access-log-format acceptor) :json)
                   :max-header-bytes (acceptor-max-header-bytes acceptor)
                   :max-body-bytes (acceptor-max-body-bytes acceptor)
                   :compression (acceptor-compression acceptor)
                   :buffer (make-array (head-buffer-bytes acceptor) :element-type '(unsigned-byte 8))
                   :constructors (engine-object-constructors engine)
                   :plain-streams-reset-p (engine-plain-streams-reset-p engine)
                   :keep-alive-header-value keep-alive-value
                   :keep-alive-header-octets (header-text-octets keep-alive-value)
                   :server-header-value server-name
                   :server-header-octets (and (stringp server-name) (header-text-octets server-name))
                   :counter-stripe (mod (atomic-increment (readiness-set-counting-workers set))
                                        +request-count-stripes+)
                   :requests-in-progress-location (requests-in-progress-location acceptor)
                   :schedule-log-write (lambda (function)
                                         (schedule-timer (readiness-set-timers set)
                                                         +access-log-flush-milliseconds+ function)))))

(defmethod engine-run-worker ((engine readiness-engine) worker)
  (let* ((set (engine-readiness-set engine))
         (serving (make-serving engine worker))
         (*serving* serving)
         (hunchentoot:*acceptor* (engine-acceptor engine)))
    (unwind-protect
         (loop for token = (next-ready-token engine worker set)
               while token
               do (cond ((= token +timer-token+) (run-timers-serving-completions engine set serving))
                        ((= token +task-token+) (run-worker-task serving (take-woken-task set)))
                        (t (serve-ready-token serving token)))
                  (run-queued-tasks set serving)
                  (send-reply-batch (serving-reply-batch serving)))
      (send-reply-batch (serving-reply-batch serving))
      (free-reply-coders (shiftf (serving-coders serving) nil)))))

(defun run-timers-serving-completions (engine set serving)
  "Call SET's timers that are due, then serve the connections whose
deferred replies they completed (COMPLETE-REPLY took them), here and now
rather than through another report of the set; what an unwind leaves is
parked for output, for any worker."
  (setf (serving-completed serving) '())
  (let ((connections '()))
    (unwind-protect
         (progn (run-due-timers set (engine-acceptor engine))
                (setf connections (nreverse (shiftf (serving-completed serving) :unused)))
                (loop while connections
                      do (serve-connection serving (pop connections))))
      (setf (serving-completed serving) :unused)
      (dolist (connection connections)
        (unless (park-for-completed-reply set connection)
          (close-connection set connection))))))

(defun run-worker-task (serving task)
  "Run TASK (worker-tasks.lisp), unless it is NIL, in the worker of
SERVING: serve the token it is, or call it; an error escaping a function
is logged."
  (cond ((null task))
        ((integerp task) (serve-ready-token serving task))
        (t (handler-case (funcall task serving)
             (error (condition)
               (log-safely (serving-acceptor serving) :error "Error in a worker task: ~A" condition))))))

(defun run-queued-tasks (set serving)
  "Run the tasks waiting in SET's queue, oldest first, until none waits.
Before each, the objects of the connection queued after it are asked into
the caches, a turn ahead of their use (PREFETCH-REPORTED-CONNECTION-OBJECTS)."
  (loop for task = (and (readiness-set-tasks set) (pop-worker-task set))
        while task
        do (let ((next (first (readiness-set-tasks set))))
             (when (integerp next)
               (prefetch-reported-connection-objects set next)))
           (run-worker-task serving task)))

(defun serve-ready-token (serving token)
  "Serve what TOKEN, reported by SERVING's set, stands for: a new connection
on the listening socket, or a parked one."
  (let* ((engine (serving-engine serving))
         (set (serving-set serving))
         (worker (serving-worker serving))
         (new-p (= token +listen-token+))
         (connection (if new-p
                         (when-accepting (set) (take-new-connection engine set))
                         (take-ready-connection set token))))
    (note-turn-taken worker new-p)
    (when connection
      (serve-connection serving connection))))

;;; The set is NIL in the steps of a STOP below once ABANDON-ACCEPTOR, in
;;; another thread, has ended the run under it: nothing is left to do.

(defmethod engine-wake-workers ((engine readiness-engine))
  (let ((set (engine-readiness-set engine)))
    (when set
      (wake-all-waiters set))))

(defmethod engine-drain ((engine readiness-engine) deadline)
  (let ((set (engine-readiness-set engine)))
    (when set
      (stop-accepting set)
      ;; A socket from outside stays listening, its queue for the next process.
      (when (own-listen-socket-p (engine-acceptor engine))
        (take-queued-connections engine set deadline)
        (refuse-connections set))
      ;; Read in this order: a connection taken before ACCEPTING-ENDED-P is
      ;; in the table, counted.
      (loop (cond ((and (accepting-ended-p set) (zerop (unfinished-connection-count set))) (return t))
                  ((>= (get-internal-real-time) deadline) (return nil))
                  ((null (engine-readiness-set engine)) (return nil))
                  (t (sleep 0.01)))))))

(defmethod engine-close-idle-connections ((engine readiness-engine))
  (let ((set (engine-readiness-set engine)))
    (when set
      (close-parked-connections set))))

(defmethod engine-cut-connection ((engine readiness-engine) worker)
  (call-with-held-connection worker (lambda (connection) (shut-down-fd (connection-fd connection)))))

(defmethod engine-cut-handshake ((engine readiness-engine) worker)
  ;; Read from another thread than the holder's, the stream may be made
  ;; just after: the cut then ends a connection whose request, if one
  ;; comes, the stopping pool would not start.
  (call-with-held-connection worker (lambda (connection)
                                      (unless (connection-stream connection)
                                        (shut-down-fd (connection-fd connection))))))

(defmethod engine-work-waiting-p ((engine readiness-engine))
  ;; An epoll descriptor polls readable while it has events to report.
  (let ((set (engine-readiness-set engine)))
    (and set (wait-until-fd-readable (readiness-set-epoll-fd set) 0))))

(defmethod engine-maintenance-interval ((engine readiness-engine))
  +sweep-interval-seconds+)

(defun tend-memory-budget (engine set)
  "Log the beginning of an episode of SET's memory budget, once, and close
the connections holding the most until it ends."
  (let ((budget (readiness-set-memory-budget set)))
    (when (claim-memory-episode-log budget)
      (log-safely (engine-acceptor engine) :warning
                  "The memory budget (~D octets) is spent: buffers are refused and the connections ~
holding the most closed until less than ~D% of it is used."
                  (memory-budget-limit budget) (round (* 100 +memory-relief-share+))))
    (relieve-memory-pressure set)
    (end-memory-episode-if-relieved budget)))

(defmethod engine-maintain ((engine readiness-engine))
  (let ((set (engine-readiness-set engine)))
    ;; Before the deadlines: a head found complete is no longer late.
    (sweep-while-no-worker-free engine set)
    (close-expired-connections set)
    (tend-memory-budget engine set)
    (resume-accepting set)
    (write-overdue-access-logs (engine-acceptor engine))))

(defmethod engine-statistics ((engine readiness-engine))
  (append (readiness-statistics (engine-readiness-set engine) (engine-counters engine))
          (server-certificates-statistics (engine-certificates engine) (engine-certificate-counters engine))))

(defun free-engine-certificates (engine)
  (let ((certificates (shiftf (engine-certificates engine) nil)))
    (when certificates
      (free-server-certificates certificates))))

(defun reload-certificates (acceptor)
  "Load again at once each certificate of ACCEPTOR, a started
PARALLEL-SSL-ACCEPTOR, whose files changed since they were loaded, as the
engine does by itself within a second of a handshake; new handshakes get
it, connections open keep theirs.  A file that does not load is logged and
the certificate loaded before kept; then signals the CERTIFICATE-NOT-LOADED
of the first such file, once every other certificate has been looked at.
Returns the count of certificates loaded again."
  (let* ((engine (taskmaster-engine (acceptor-taskmaster acceptor)))
         (certificates (and engine (engine-certificates engine))))
    (if (null certificates)
        0
        (let ((reloads (certificate-counters-reloads (engine-certificate-counters engine)))
              (failures (bt:with-lock-held ((server-certificates-check-lock certificates))
                          (check-certificates certificates :again t))))
          (when failures
            (error (first failures)))
          (- (certificate-counters-reloads (engine-certificate-counters engine)) reloads)))))

(defun end-engine-run (engine close-connections)
  "End ENGINE's run: its connections closed by CLOSE-CONNECTIONS (called
with the set), its set destroyed with the timers that would have written
the access log entries kept (written here), its certificates freed."
  (let ((set (shiftf (engine-readiness-set engine) nil)))
    (when set
      (funcall close-connections set)
      (destroy-readiness-set set)))
  (write-every-access-log (engine-acceptor engine))
  (free-engine-certificates engine))

(defmethod engine-finish ((engine readiness-engine))
  (end-engine-run engine #'close-parked-connections))

(defmethod engine-abandon ((engine readiness-engine))
  (end-engine-run engine #'close-every-connection))
