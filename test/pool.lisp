;;;; The thread pool: sizes, growth, retirement, stop, forced teardown.
;;;; Pool tests run once per standby size in *STANDBY-SIZES*, each with a
;;;; thread-leak check.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite pool :in all :description "The recycling taskmaster's thread pool.")
(in-suite pool)

(ht:define-easy-handler (test-sleep :uri "/test/sleep") (ms)
  (sleep (/ (parse-integer ms) 1000))
  "slept")

(ht:define-easy-handler (test-yo :uri "/test/yo") ()
  (setf (ht:content-type*) "text/plain")
  "Hey!")

(defparameter *standby-sizes* '(1 4 8))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *blocking-engine* '(:blocking)
    "For tests of what only the blocking engine does: queueing and 503s."))

(defmacro define-pool-test (name (standby-var &key (engines '*engines*)) &body body)
  "Define NAME.<engine> for each connection engine in ENGINES, running BODY
once for each standby size, bound to STANDBY-VAR."
  `(define-engine-test ,name (:engines ,engines)
     (dolist (,standby-var *standby-sizes*)
       (with-thread-leak-check ()
         ,@body))))

(defun concurrent-gets (server path count)
  "GET PATH from COUNT threads at once; the list of status codes."
  (mapcar (lambda (join) (first (funcall join)))
          (loop repeat count
                collect (in-thread (lambda () (http-get server path))))))

(test config.rejects-impossible-combinations
  (flet ((rejected-p (&rest initargs)
           (handler-case (progn (apply #'make-instance 'recycling-taskmaster initargs) nil)
             (invalid-taskmaster-configuration (condition)
               (and (plusp (length (princ-to-string condition))) t)))))
    (is (rejected-p :standby-thread-count 10 :max-thread-count 5 :max-accept-count 20))
    (is (rejected-p :standby-thread-count -1))
    (is (rejected-p :standby-thread-count 0))
    (is (rejected-p :standby-thread-count 2.5))
    (is (rejected-p :standby-thread-count "8"))
    (is (rejected-p :max-thread-count -3 :max-accept-count nil))
    (is (rejected-p :max-thread-count 10 :max-accept-count 10))
    (is (rejected-p :max-thread-count nil :max-accept-count 10))
    (is (rejected-p :thread-idle-timeout 0))
    (is (not (rejected-p :standby-thread-count 4 :max-thread-count 4 :max-accept-count nil)))
    (is (not (rejected-p :max-thread-count nil :max-accept-count nil)))))

(test config.defaults
  (let ((taskmaster (make-instance 'recycling-taskmaster)))
    (is (= *default-standby-thread-count* (taskmaster-standby-thread-count taskmaster)))
    (is (= 8 *default-standby-thread-count*))
    (is (= 100 (ht:taskmaster-max-thread-count taskmaster)))
    (is (= 120 (ht:taskmaster-max-accept-count taskmaster))))
  (dolist (class '(parallel-acceptor parallel-easy-acceptor))
    (is (eql 0 (getf (taskmaster-statistics (make-instance class)) :threads))
        "~S has a recycling taskmaster by default" class)))

(test acceptor.requires-parallel-acceptor
  (with-thread-leak-check ()
    (let ((acceptor (make-server 'ht:easy-acceptor :taskmaster (make-instance 'recycling-taskmaster))))
      (signals acceptor-not-parallel-error (ht:start acceptor))
      (is (not (ht:started-p acceptor)) "the failed start leaves the port free"))))

(defun request-in-flight (server path)
  "GET PATH from SERVER in a new thread and return once the server is inside
the request; returns the function that joins the client (see IN-THREAD)."
  (prog1 (in-thread (lambda () (http-get server path)))
    (wait-until (lambda () (plusp (stats server :in-request-threads))))))

(defun kill-a-worker ()
  "Destroy one worker thread of whichever pool runs, and wait until it is dead."
  (let ((worker (find-if (lambda (thread) (search "recycling-worker" (bt:thread-name thread)))
                         (bt:all-threads))))
    (bt:destroy-thread worker)
    (wait-until (lambda () (not (bt:thread-alive-p worker))))))

(define-pool-test pool.start-makes-standby-threads (standby)
  (with-server (server (pooled-server :standby-thread-count standby))
    (is (= standby (stats server :threads)))
    (is (= standby (stats server :accepting-threads)))
    (is (eql 200 (http-get server "/test/yo")))))

(define-pool-test pool.grows-under-load-and-shrinks-after (standby)
  (with-server (server (pooled-server :standby-thread-count standby :thread-idle-timeout 0.2))
    (let ((statuses (concurrent-gets server "/test/sleep?ms=100" 50)))
      (is (every (lambda (status) (eql 200 status)) statuses) "statuses ~S" statuses))
    (is (< standby (stats server :peak-threads)) "the pool grew past standby")
    (is (<= (stats server :peak-threads) 100))
    (is (wait-until (lambda () (= standby (stats server :threads))) :timeout 10)
        "the pool shrank back to ~D, it holds ~D" standby (stats server :threads))
    (is (plusp (stats server :threads-retired)))
    (is (<= 50 (stats server :requests-served)))))

(define-pool-test pool.never-exceeds-max-thread-count (standby)
  (with-server (server (pooled-server :standby-thread-count standby :max-thread-count 8
                                      :max-accept-count 100))
    (let ((statuses (concurrent-gets server "/test/sleep?ms=100" 30)))
      (is (every (lambda (status) (eql 200 status)) statuses)
          "connections past the thread limit are queued and served: ~S" statuses))
    (is (= 8 (stats server :peak-threads)))))

(define-pool-test pool.answers-503-past-max-accept-count (standby :engines *blocking-engine*)
  (with-server (server (pooled-server :standby-thread-count (min standby 2)
                                      :max-thread-count 2 :max-accept-count 3))
    (let ((statuses (concurrent-gets server "/test/sleep?ms=500" 8)))
      (is (every (lambda (status) (member status '(200 503))) statuses) "statuses ~S" statuses)
      (is (<= 3 (count 200 statuses)))
      (is (plusp (count 503 statuses)))
      (is (= (count 503 statuses) (stats server :connections-rejected))))))

(define-pool-test pool.counts-are-zero-after-stop (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (with-server (server server)
      (concurrent-gets server "/test/yo" 10))
    (is (= 0 (stats server :threads)))
    (is (= 0 (stats server :busy-threads)))
    (is (= 0 (stats server :accepting-threads)))
    (is (= 0 (stats server :in-request-threads)))))

(define-pool-test pool.restarts-on-the-same-port (standby)
  (let* ((port (free-port))
         (server (make-server 'parallel-easy-acceptor
                              :port port
                              :taskmaster (make-instance 'recycling-taskmaster
                                                         :standby-thread-count standby))))
    (is (loop repeat 20
              always (progn (ht:start server)
                            (prog1 (eql 200 (http-get server "/test/yo"))
                              (ht:stop server)))))))

(define-pool-test pool.survives-handler-errors-and-dropped-clients (standby)
  (with-server (server (pooled-server :standby-thread-count standby))
    (is (eql 500 (http-get server "/test/error")))
    ;; A client that leaves in the middle of its request head...
    (let ((socket (connect server)))
      (send-text socket "GET /test/yo HTTP/1.1\r\nHost: loc")
      (usocket:socket-close socket))
    ;; ...and one that leaves in the middle of a 10 MB reply.
    (let ((socket (connect server)))
      (send-text socket (crlf-lines "GET /test/large HTTP/1.1" "Host: localhost" ""))
      (read-byte (usocket:socket-stream socket))
      (usocket:socket-close socket))
    (is (wait-until (lambda () (and (zerop (stats server :busy-threads))
                                     (= standby (stats server :threads))))
                    :timeout 10)
        "every worker is free again and the pool is back to ~D" standby)
    (is (eql 200 (http-get server "/test/yo")))))

(define-pool-test pool.replaces-a-dead-worker (standby)
  (with-server (server (pooled-server :standby-thread-count standby))
    (is (kill-a-worker))
    (is (wait-until (lambda () (= standby (stats server :accepting-threads)))))
    (is (eql 200 (http-get server "/test/yo")))))

(define-pool-test pool.soft-stop-finishes-requests-in-flight (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (let ((client (request-in-flight server "/test/sleep?ms=700")))
      (ht:stop server :soft t)
      (destructuring-bind (status body) (funcall client)
        (is (eql 200 status))
        (is (equal "slept" body))))
    (is (= 0 (stats server :threads)))))

(define-pool-test pool.hard-stop-cuts-requests-in-flight (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (let ((client (request-in-flight server "/test/sleep?ms=5000"))
          (start (get-internal-real-time)))
      (ht:stop server)
      (is (< (- (get-internal-real-time) start) (* 2 internal-time-units-per-second))
          "hard stop returns without waiting for the 5 s handler")
      (is (not (eql 200 (first (funcall client))))))
    (is (= 0 (stats server :threads)))))

;;; STOP's interrupt may land just before a worker enters its cut point or
;;; just after it left, still in a state STOP cuts: the worker must go on
;;; (a THROW without its catcher would end the thread, or the whole Lisp).
(test stop.cut-lands-only-inside-a-cut-point
  (with-thread-leak-check ()
    (let* ((worker (hunchentoot-recycling-taskmaster::make-worker nil))
           (phase :starting)
           (thread (bt:make-thread
                    (lambda ()
                      (setf (hunchentoot-recycling-taskmaster::worker-thread worker) (bt:current-thread))
                      (handler-case
                          (flet ((wait-for (awaited)
                                   (loop repeat 1000 until (eq phase awaited) do (sleep 0.01))))
                            (setf phase :outside)
                            (wait-for :go-inside)
                            (hunchentoot-recycling-taskmaster::with-connection-cut-point ()
                              (setf phase :inside)
                              (wait-for :never)
                              :not-cut))
                        (error (condition) condition)))
                    :name "cut-point test worker"))
           (states '(:handshaking)))
      (setf (hunchentoot-recycling-taskmaster::worker-state worker) :handshaking)
      (flet ((cut ()
               (setf (hunchentoot-recycling-taskmaster::worker-cut-requested-p worker) t)
               (hunchentoot-recycling-taskmaster::cut-connection worker states)))
        (is (wait-until (lambda () (eq phase :outside))))
        (cut)
        (is (wait-until (lambda () (not (hunchentoot-recycling-taskmaster::worker-cut-requested-p worker))))
            "the interrupt outside the cut point ran, and left the worker to be cut later")
        (setf phase :go-inside)
        (is (wait-until (lambda () (eq phase :inside))))
        (cut)
        (is (eq nil (bt:join-thread thread)) "the cut inside the cut point ends it")))))

(define-pool-test pool.stop-closes-idle-keep-alive-connections (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (let ((socket (connect server)))
      (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" ""))
      (is (eql 200 (read-response socket)))
      (let ((start (get-internal-real-time)))
        (ht:stop server)
        (is (< (- (get-internal-real-time) start) internal-time-units-per-second)
            "stop does not wait for the idle connection's read timeout"))
      (usocket:socket-close socket))))

(defun abandon-and-check-port (server)
  (let ((port (ht:acceptor-port server)))
    (abandon-acceptor server)
    (is (not (ht:started-p server)))
    (is (= 0 (stats server :threads)))
    (with-server (again (make-server 'parallel-easy-acceptor :port port))
      (is (eql 200 (http-get again "/test/yo")) "the port is reusable at once"))))

(define-pool-test abandon.idle (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (abandon-and-check-port server)))

(define-pool-test abandon.mid-request (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (let ((client (request-in-flight server "/test/sleep?ms=5000")))
      (abandon-and-check-port server)
      (is (not (eql 200 (first (funcall client))))))))

(define-pool-test abandon.with-a-dead-worker (standby)
  (let ((server (pooled-server :standby-thread-count standby)))
    (ht:start server)
    (kill-a-worker)
    (abandon-and-check-port server)))

(define-engine-test abandon.while-the-pool-grows ()
  ;; The thread-making thread is busiest here: a worker it makes while the
  ;; pool is abandoned must not outlive it, nor count the pool below zero.
  (with-thread-leak-check ()
    (loop repeat 5
          do (let* ((server (pooled-server :standby-thread-count 1 :max-thread-count 40))
                    (clients (progn (ht:start server)
                                    (loop repeat 30
                                          collect (in-thread (lambda () (http-get server "/test/sleep?ms=300")))))))
               (wait-until (lambda () (< 1 (stats server :threads))))
               (abandon-acceptor server)
               (mapc #'funcall clients)
               (is (= 0 (stats server :threads)))
               (sleep 0.2)
               (is (= 0 (stats server :threads)) "still none, and none below zero, a moment later")))))

(ht:define-easy-handler (test-stubborn :uri "/test/stubborn") ()
  ;; Its cleanup outlives the stop timeout of the test below.
  (unwind-protect (sleep 10) (sleep 3)))

(define-engine-test stop.signals-corrupted-when-a-worker-outlives-the-stop-timeout ()
  (with-thread-leak-check ()
    (let ((server (pooled-server :standby-thread-count 2 :stop-timeout 1)))
      (ht:start server)
      (let ((client (request-in-flight server "/test/stubborn")))
        (let ((condition nil))
          (handler-bind ((recycling-taskmaster-corrupted-error
                           (lambda (c)
                             (setf condition c)
                             (invoke-restart 'abandon-acceptor))))
            (ht:stop server))
          (is (typep condition 'recycling-taskmaster-corrupted-error))
          (is (search "did not end" (princ-to-string condition))))
        (is (not (ht:started-p server)))
        (funcall client)))))

(test api.every-exported-symbol-is-documented
  (do-external-symbols (symbol '#:hunchentoot-recycling-taskmaster)
    (is (or (documentation symbol 'function)
            (documentation symbol 'variable)
            (documentation symbol 'type))
        "~S has no docstring" symbol)))

(define-pool-test pool.queued-connection-reclaims-an-idle-kept-alive-worker (standby :engines *blocking-engine*)
  (with-server (server (pooled-server :standby-thread-count (min standby 2)
                                      :max-thread-count 2 :max-accept-count 5))
    (let ((kept-alive (list (connect server) (connect server)))
          (late (connect server)))
      (unwind-protect
           (progn
             (dolist (socket kept-alive)
               (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" ""))
               (is (eql 200 (read-response socket))))
             (is (= 2 (stats server :busy-threads)) "both workers hold an idle connection")
             (send-text late (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" ""))
             (multiple-value-bind (status body) (read-response late)
               (is (eql 200 status) "the queued connection is served within seconds")
               (is (equal "Hey!" body)))
             (is (= 1 (count-if #'closed-by-server-p kept-alive))
                 "one idle kept-alive connection was closed for it"))
        (mapc #'usocket:socket-close (cons late kept-alive))))))

(define-engine-test statistics.counts-what-happened ()
  (with-thread-leak-check ()
    (with-server (server (pooled-server :standby-thread-count 2))
      (dotimes (i 5) (http-get server "/test/yo"))
      ;; A worker counts a request once it has flushed the reply, which the
      ;; client may have read a moment before.
      (wait-until (lambda () (<= 5 (stats server :requests-served))))
      (let ((statistics (taskmaster-statistics server)))
        (dolist (key '(:threads :busy-threads :accepting-threads :in-request-threads
                       :queued-connections :connections-accepted :connections-rejected
                       :requests-served :threads-created :threads-retired :peak-threads
                       :parked-connections :open-connections :keep-alive-timeouts
                       :bad-request-replies :header-timeout-replies :length-required-replies
                       :uri-too-long-replies
                       :header-too-large-replies :version-not-supported-replies))
          (is (integerp (getf statistics key)) "~S is missing" key))
        (is (= 5 (getf statistics :requests-served)))
        (is (= 5 (getf statistics :connections-accepted)) "drakma closes each connection")
        (is (= 0 (getf statistics :connections-rejected)))
        (is (<= 2 (getf statistics :threads-created)))))))

(defun keep-alive-client (server deadline)
  "Connect to SERVER as soon as it listens, then send requests on the one
connection until DEADLINE (internal real time).  Counts the 200 replies."
  (let ((socket (loop while (< (get-internal-real-time) deadline)
                      thereis (ignore-errors (connect server))
                      do (sleep 0.01))))
    (unwind-protect
         (loop while (and socket (< (get-internal-real-time) deadline))
               count (handler-case
                         (progn
                           (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" ""))
                           (eql 200 (read-response socket)))
                       (error () (loop-finish))))
      (when socket (ignore-errors (usocket:socket-close socket))))))

(define-engine-test pool.starts-under-immediate-load ()
  ;; Clients already hammering the port when START runs keep the standby
  ;; workers busy; START must not wait for them all to be idle at once.
  (with-thread-leak-check ()
    (let* ((port (free-port))
           (server (make-server 'parallel-easy-acceptor
                                :port port
                                :taskmaster (make-instance 'recycling-taskmaster
                                                           :standby-thread-count 4)))
           (deadline (+ (get-internal-real-time) (* 12 internal-time-units-per-second)))
           (clients (loop repeat 8
                          collect (in-thread (lambda () (keep-alive-client server deadline))))))
      (unwind-protect
           (progn
             (finishes (ht:start server))
             (is (ht:started-p server))
             (is (every #'plusp (mapcar (lambda (join) (first (funcall join))) clients))
                 "every client was served"))
        (when (ht:started-p server)
          (ht:stop server))))))
