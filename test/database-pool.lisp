;;;; The PostgreSQL store's connection pool (postgresql/connection-pool.lisp)
;;;; without a server: its connections are cl-postgres connection objects
;;;; never opened, and the failures are signalled by the tests' functions.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite database-pool :in all :description "The connection pool of the PostgreSQL session store.")
(in-suite database-pool)

(defun unopened-connection ()
  "A cl-postgres connection object with no socket: closing it does nothing."
  (make-instance 'cl-postgres:database-connection))

(defun broken-connection ()
  "Signal what cl-postgres signals for a connection the server closed."
  (error 'cl-postgres:database-connection-error :message "the test broke the connection"))

(defun pool-counts (pool)
  "POOL's open connections and idle ones."
  (list (hrt::database-pool-open-count pool) (length (hrt::database-pool-idle pool))))

(test database-pool.a-second-broken-connection-is-signalled
  ;; The retry after a broken connection may take one another thread gave
  ;; back meanwhile, and find it broken too (a server restart breaks them
  ;; all): that failure is the caller's, not a third try nor a value.
  (let* ((pool (hrt::make-database-pool #'unopened-connection 2))
         (held (bt:make-semaphore)) (release (bt:make-semaphore)) (released (bt:make-semaphore))
         (holder (in-thread (lambda ()
                              (hrt::call-with-database-connection
                               pool (lambda (connection)
                                      (declare (ignore connection))
                                      (bt:signal-semaphore held)
                                      (bt:wait-on-semaphore release :timeout 10)))
                              (bt:signal-semaphore released))))
         (calls 0))
    (is-true (bt:wait-on-semaphore held :timeout 10))
    ;; An idle connection, so that the call below takes one that served before.
    (hrt::call-with-database-connection pool (lambda (connection) connection))
    (is (equal '(2 1) (pool-counts pool)))
    (let ((outcome (handler-case
                       (list :returned
                             (hrt::call-with-database-connection
                              pool (lambda (connection)
                                     (declare (ignore connection))
                                     (incf calls)
                                     (if (= calls 1)
                                         ;; Unwound after the pool dropped this connection and
                                         ;; the idle ones: the holder gives its connection back.
                                         (unwind-protect (broken-connection)
                                           (bt:signal-semaphore release)
                                           (bt:wait-on-semaphore released :timeout 10))
                                         (broken-connection)))))
                     (cl-postgres:database-connection-error () :signalled))))
      (is (eq :signalled outcome) "the second broken connection ended the call with ~S" outcome))
    (is (= 2 calls) "the statement was tried ~D times" calls)
    (funcall holder)
    (is (equal '(0 0) (pool-counts pool)) "a broken connection is still counted: ~S" (pool-counts pool))))

(defun failing-connect (attempts &key (until (lambda () nil)))
  "A connect function that counts its calls in the car of ATTEMPTS and fails
until UNTIL, called with no arguments, is true."
  (lambda ()
    (incf (car attempts))
    (if (funcall until)
        (unopened-connection)
        (error 'cl-postgres:database-socket-error :message "the test refuses connections"))))

(defun pool-call-outcome (pool)
  "What a call of POOL came to: :CONNECTED, :REFUSED (the connect function
failed) or :HELD-BACK (DATABASE-UNREACHABLE)."
  (handler-case (progn (hrt::call-with-database-connection pool #'identity) :connected)
    (hrt::database-unreachable () :held-back)
    (cl-postgres:database-socket-error () :refused)))

(test database-pool.refused-connections-tried-once-per-interval
  (let* ((attempts (list 0))
         (pool (hrt::make-database-pool (failing-connect attempts) 8 3600)))
    (is (eq :refused (pool-call-outcome pool)))
    (let ((outcomes (loop repeat 1000 collect (pool-call-outcome pool))))
      (is (equal '(:held-back) (remove-duplicates outcomes)) "calls within the interval: ~S"
          (remove-duplicates outcomes)))
    (is (= 1 (car attempts)) "~D attempts to connect within the interval" (car attempts))
    (is (equal '(0 0) (pool-counts pool))))
  (let* ((attempts (list 0)) (accepting nil)
         (pool (hrt::make-database-pool (failing-connect attempts :until (lambda () accepting)) 8 1/20)))
    (is (eq :refused (pool-call-outcome pool)))
    (is-true (wait-until (lambda () (pool-call-outcome pool) (= 2 (car attempts))) :interval 0.01)
             "no second attempt after the interval")
    (setf accepting t)
    (is-true (wait-until (lambda () (eq :connected (pool-call-outcome pool))) :interval 0.01))
    ;; Connecting works again: every call may open a connection.
    (let ((joins (loop repeat 4 collect (in-thread (lambda () (pool-call-outcome pool))))))
      (is (equal '((:connected)) (remove-duplicates (mapcar #'funcall joins) :test #'equal))))))

(test database-pool.one-attempt-at-a-time-after-a-failure
  (let* ((attempts (list 0)) (accepting nil)
         (connecting (bt:make-semaphore)) (answer (bt:make-semaphore))
         (pool (hrt::make-database-pool (lambda ()
                                          (incf (car attempts))
                                          (unless accepting
                                            (error 'cl-postgres:database-socket-error :message "refused"))
                                          (bt:signal-semaphore connecting)
                                          (bt:wait-on-semaphore answer :timeout 10)
                                          (unopened-connection))
                                        8 0)))
    (is (eq :refused (pool-call-outcome pool)))
    (setf accepting t)
    (let ((probe (in-thread (lambda () (pool-call-outcome pool)))))
      (is-true (bt:wait-on-semaphore connecting :timeout 10))
      (is (eq :held-back (pool-call-outcome pool)) "a second attempt while one is under way")
      (is (= 2 (car attempts)))
      (bt:signal-semaphore answer)
      (is (equal '(:connected) (funcall probe))))
    (is (eq :connected (pool-call-outcome pool)) "held back after an attempt succeeded")))

(test database-pool.store-muffles-cl-postgres-warnings
  (let* ((store (make-instance 'hrt::postgresql-session-store
                               :description "test" :pool (hrt::make-database-pool #'unopened-connection 1)))
         (warnings '()))
    (handler-bind ((warning (lambda (condition) (push condition warnings))))
      (is (eq :done (hrt::with-session-database (connection store)
                      (declare (ignore connection))
                      (warn "Ignoring the error which happened while trying to close~% PostgreSQL socket")
                      :done))))
    (is (null warnings) "a warning reached the request: ~S" warnings)))
