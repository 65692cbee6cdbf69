;;;; A saturated pool: every worker the pool may have is held by a handler.
;;;; Requests that arrive meanwhile wait for a worker, bounded by the queue
;;;; timeout (503 with Retry-After), not by the header timeout (408).

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite saturation :in all :description "Requests that find every worker busy.")
(in-suite saturation)

(defvar *holding-released-p* nil
  "Set to let the handlers of /test/hold return.")

(ht:define-easy-handler (test-hold :uri "/test/hold") ()
  (setf (ht:content-type*) "text/plain")
  ;; 20 s at most, so that a failing test cannot hold a worker for ever.
  (loop repeat 2000 until *holding-released-p* do (sleep 0.01))
  "released")

(defun seconds-since (start)
  (/ (- (get-internal-real-time) start) internal-time-units-per-second))

(defun two-worker-pool ()
  (make-instance 'recycling-taskmaster :standby-thread-count 2 :max-thread-count 2))

(defmacro with-every-worker-held ((server) &body body)
  "Run BODY while both workers of SERVER serve /test/hold for two client
threads; then let them go, and check that each client got its 200."
  (let ((clients (gensym "CLIENTS")))
    `(let ((,clients '()))
       (setf *holding-released-p* nil)
       (unwind-protect
            (progn
              (dotimes (index 2)
                (push (in-thread (lambda () (http-get ,server "/test/hold" :verify nil))) ,clients))
              (is (wait-until (lambda () (= 2 (stats ,server :in-request-threads))))
                  "both workers hold a request")
              ,@body)
         (setf *holding-released-p* t)
         (dolist (client ,clients)
           (is (eql 200 (first (funcall client))) "a held request is answered once let go"))))))

(test saturation.complete-request-gets-503-at-the-queue-timeout
  (with-readiness-server (server :queue-timeout 2 :header-timeout 1
                                 :taskmaster (two-worker-pool))
    (with-every-worker-held (server)
      (with-connection (prompt server)
        (with-connection (late server)
          (let ((start (get-internal-real-time)))
            (send-text prompt (get-request "/test/yo"))
            ;; Sent 0.5 s after connecting, the request is complete before
            ;; the header timeout (1 s) and waits past it: 503, not 408.
            (sleep 0.5)
            (send-text late (get-request "/test/yo"))
            (multiple-value-bind (status body head) (read-response prompt :timeout 6)
              (declare (ignore body))
              (is (eql 503 status) "a complete request that waits is answered 503, got ~S" status)
              (is (<= 1.9 (seconds-since start) 3) "at the 2 s queue timeout: after ~,2F s" (seconds-since start))
              (is (cl-ppcre:scan "(?im)^retry-after: 2\\r$" head) "with Retry-After: ~S" head)
              (is (cl-ppcre:scan "(?im)^date: " head) "with Date: ~S" head))
            (is-true (closed-by-server-p prompt))
            (is (eql 503 (read-response late :timeout 6)) "sent after 0.5 s, still 503, not 408")
            (is (<= (seconds-since start) 4.5) "within 3 s of its sending: ~,2F s after the first"
                (seconds-since start))))))
      (is (= 2 (stats server :queue-timeout-replies)))
      (is (= 0 (stats server :header-timeout-replies)))))

(test saturation.waiting-request-is-served-when-a-worker-frees
  (with-readiness-server (server :queue-timeout 10 :header-timeout 1
                                 :taskmaster (two-worker-pool))
    (with-connection (waiting server)
      (with-every-worker-held (server)
        (send-text waiting (get-request "/test/yo"))
        ;; Past the header timeout, the request still waits.
        (sleep 1.5))
      (is (eql 200 (read-response waiting :timeout 5)) "served by the first worker let go"))
    (is (= 0 (stats server :queue-timeout-replies)))
    (is (= 0 (stats server :header-timeout-replies)))))

(test saturation.requests-ready-beside-a-held-worker-go-to-workers-the-pool-adds
  ;; The one worker of the pool takes a request whose handler holds it;
  ;; the kept-alive requests ready with it go to workers added meanwhile.
  (setf *holding-released-p* nil)
  (with-readiness-server (server :taskmaster (make-instance 'recycling-taskmaster
                                                            :standby-thread-count 1
                                                            :max-thread-count 4
                                                            :max-accept-count 5))
    (unwind-protect
         (with-kept-alive-connections (sockets server 12)
           (is-true (connections-parked-p server 12))
           (loop for socket in sockets
                 for index from 0
                 do (send-text socket (get-request (if (= index 3) "/test/hold" "/test/yo"))))
           (is (every (lambda (socket) (eql 200 (read-response socket :timeout 10)))
                      (remove (fourth sockets) sockets))
               "every other request is answered while one handler holds its worker")
           (setf *holding-released-p* t)
           (multiple-value-bind (status body) (read-response (fourth sockets) :timeout 10)
             (is (eql 200 status))
             (is (equal "released" body))))
      (setf *holding-released-p* t))))

(defclass thread-refusing-taskmaster (recycling-taskmaster)
  ((refusals :initform 0 :accessor refusals
             :documentation "How many of the next worker threads the system refuses."))
  (:documentation "A taskmaster whose system refuses worker threads while REFUSALS is positive."))

(defmethod ht:start-thread ((taskmaster thread-refusing-taskmaster) thunk &key name)
  (if (and (plusp (refusals taskmaster)) (search "worker" name))
      (progn (decf (refusals taskmaster))
             (error "the system refuses a thread (test)"))
      (call-next-method)))

(test saturation.a-worker-thread-the-system-refused-is-asked-for-again
  ;; The one worker holds a request; the next request asks for another
  ;; worker, whose thread the system refuses once.  The pool asks again and
  ;; the request is answered while the first is still held, where it used
  ;; to wait for the held handler to end.
  (setf *holding-released-p* nil)
  (let ((taskmaster (make-instance 'thread-refusing-taskmaster :standby-thread-count 1)))
    (with-readiness-server (server :taskmaster taskmaster)
      (let ((held (in-thread (lambda () (http-get server "/test/hold")))))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (= 1 (stats server :in-request-threads)))) "the one worker held")
               (setf (refusals taskmaster) 1)
               (is (eql 200 (http-get server "/test/yo")) "the next request answered")
               (is (zerop (refusals taskmaster)) "after the system refused a thread")
               ;; The second worker may count its request a moment after
               ;; the reply has gone.
               (is (wait-until (lambda () (= 1 (stats server :in-request-threads))))
                   "while the first is still held"))
          (setf *holding-released-p* t)
          (is (eql 200 (first (funcall held)))))))))

(test saturation.head-begun-before-saturation-is-queued-when-complete
  (with-readiness-server (server :queue-timeout 2 :header-timeout 5 :taskmaster (two-worker-pool))
    (with-connection (split server)
      ;; A worker parks the first half of the head with the connection.
      (send-text split (concatenate 'string (crlf-lines "GET /test/yo HTTP/1.1") "Host: loc"))
      (is-true (connections-parked-p server 1))
      (with-every-worker-held (server)
        (let ((start (get-internal-real-time)))
          (send-text split (crlf-lines "alhost" ""))
          (is (eql 503 (read-response split :timeout 6))
              "the parked half and the rest make a complete head, which waits, then gets 503")
          (is (<= 1.9 (seconds-since start) 3) "at the queue timeout: after ~,2F s" (seconds-since start)))))
    (is (= 1 (stats server :queue-timeout-replies)))))

(test saturation.incomplete-head-still-gets-408
  (with-readiness-server (server :queue-timeout 5 :header-timeout 1
                                 :taskmaster (two-worker-pool))
    (with-every-worker-held (server)
      (with-connection (partial server)
        (let ((start (get-internal-real-time)))
          (send-text partial (concatenate 'string (crlf-lines "GET /test/yo HTTP/1.1") "Host: loc"))
          (is (eql 408 (read-response partial :timeout 5)) "a head that never ends is late, not queued")
          (is (<= 0.9 (seconds-since start) 2.5)))))
    (is (= 1 (stats server :header-timeout-replies)))
    (is (= 0 (stats server :queue-timeout-replies)))))

(test saturation.bad-head-is-refused-while-waiting
  (with-readiness-server (server :queue-timeout 5
                                 :taskmaster (two-worker-pool))
    (with-every-worker-held (server)
      (with-connection (bad server)
        (let ((start (get-internal-real-time)))
          (send-text bad (get-request "/test/yo" "No colon here"))
          (is (eql 400 (read-response bad :timeout 5)))
          (is (< (seconds-since start) 1.5) "at the next sweep, not when a worker frees"))))
    (is (= 1 (stats server :bad-request-replies)))))

(test saturation.kept-alive-tls-request-gets-503
  (with-thread-leak-check ()
    (multiple-value-bind (certificate key) (certificate-files)
      (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                        :ssl-certificate-file certificate :ssl-privatekey-file key
                                        :queue-timeout 2 :taskmaster (two-worker-pool)))
        (multiple-value-bind (stream socket) (tls-connect server)
          (unwind-protect
               (flet ((send (text)
                        (write-sequence (flex:string-to-octets text) stream)
                        (finish-output stream)))
                 (send (get-request "/test/yo"))
                 (is (eql 200 (read-stream-response stream)) "a first request, kept alive")
                 (with-every-worker-held (server)
                   (let ((start (get-internal-real-time)))
                     (send (get-request "/test/yo"))
                     (is (eql 503 (read-stream-response stream)) "the next one waits, then gets 503")
                     (is (<= 1.9 (seconds-since start) 3.5) "after ~,2F s" (seconds-since start)))))
            (ignore-errors (close stream))
            (usocket:socket-close socket)))
        (is (= 1 (stats server :queue-timeout-replies)))))))

;;; Connections queued behind a busy set (TAKE-NEW-CONNECTION), on an engine
;;; started by hand with no worker: none is free, and nothing else accepts.

(defun accept-queue-length (port)
  "How many connections the kernel has queued on the socket listening on
PORT of 127.0.0.1: the receive queue /proc/net/tcp reports for it."
  (with-open-file (table "/proc/net/tcp")
    (loop for line = (read-line table nil)
          while line
          do (destructuring-bind (&optional slot local remote state queues &rest more)
                 (cl-ppcre:split "\\s+" (string-trim " " line))
               (declare (ignore slot remote more))
               (when (and (equal state "0A")
                          (equal local (format nil "0100007F:~4,'0X" port)))
                 (return (parse-integer queues :start (1+ (position #\: queues)) :radix 16)))))))

(defmacro with-engine-without-workers ((engine set port) &body body)
  "Run BODY with the readiness ENGINE of an acceptor listening on PORT, its
SET started, and no worker."
  (let ((acceptor (gensym "ACCEPTOR")))
    `(let ((,acceptor (make-server 'parallel-easy-acceptor :taskmaster (make-instance 'recycling-taskmaster))))
       ;; What HUNCHENTOOT:START does before it starts the taskmaster.
       (setf (ht:taskmaster-acceptor (ht::acceptor-taskmaster ,acceptor)) ,acceptor
             (hrt::acceptor-shutting-down-p ,acceptor) nil)
       (ht:start-listening ,acceptor)
       (let ((,engine (hrt::taskmaster-engine-for (ht::acceptor-taskmaster ,acceptor)))
             (,port (usocket:get-local-port (hrt::acceptor-listen-socket ,acceptor))))
         (declare (ignorable ,port))
         (unwind-protect
              (progn (hrt::engine-start ,engine)
                     (let ((,set (hrt::engine-readiness-set ,engine)))
                       ,@body))
           (hrt::engine-finish ,engine)
           (usocket:socket-close (hrt::acceptor-listen-socket ,acceptor)))))))

(test saturation.connections-queued-behind-a-busy-set-are-taken-together
  (with-engine-without-workers (engine set port)
    (let ((clients '()))
      (flet ((queue-requests (count)
               (dotimes (index count)
                 (let ((socket (connect-to-port port)))
                   (push socket clients)
                   (send-text socket (get-request "/test/yo"))))
               (wait-until (lambda () (eql count (accept-queue-length port)))))
             (take-after-waiting (microseconds)
               (setf (hrt::readiness-set-listen-armed-at set) (- (hrt::monotonic-microseconds) microseconds))
               (let ((connection (hrt::take-new-connection engine set)))
                 (when connection
                   (hrt::close-connection set connection))
                 connection)))
        (unwind-protect
             (progn
               (is-true (queue-requests 4) "four connections queued")
               (is-true (take-after-waiting 20000))
               (is (= 3 (hrt::parked-connection-count set))
                   "a report that waited 20 ms: the three queued behind the first are taken and parked, ~D"
                   (hrt::parked-connection-count set))
               (is (eql 0 (accept-queue-length port)))
               (is-true (queue-requests 3) "three more queued")
               (is-true (take-after-waiting 0))
               (is (= 3 (hrt::parked-connection-count set))
                   "a report that did not wait: only the first is taken, ~D parked"
                   (hrt::parked-connection-count set))
               (is (eql 2 (accept-queue-length port))))
          (mapc #'usocket:socket-close clients))))))

(test saturation.one-wait-takes-several-events-the-timer-first-and-the-sweep-those-queued
  (with-engine-without-workers (engine set port)
    (let ((clients '())
          (epoll-fd (hrt::readiness-set-epoll-fd set))
          (task (lambda (serving) (declare (ignore serving)))))
      (flet ((connection-of (token)
               (svref (hrt::readiness-set-slots set) (hrt::slot-index token))))
        (unwind-protect
             (progn
               (dotimes (index 5)
                 (let ((socket (connect-to-port port)))
                   (push socket clients)
                   (send-text socket (get-request "/test/yo"))))
               (is-true (wait-until (lambda () (eql 5 (accept-queue-length port)))))
               ;; Taken as by a worker woken late while no worker is free:
               ;; the four behind the first are parked, their heads there.
               (setf (hrt::readiness-set-listen-armed-at set) (- (hrt::monotonic-microseconds) 20000))
               (hrt::close-connection set (hrt::take-new-connection engine set))
               (is (= 4 (hrt::parked-connection-count set)))
               ;; A timer due: reported with them, it goes first.
               (hrt::schedule-timer (hrt::readiness-set-timers set) 0 (lambda ()))
               (sleep 0.01)
               (sb-alien:with-alien ((events (array (sb-alien:unsigned 8) #.(* 16 hrt::+epoll-event-bytes+))))
                 (let* ((sap (sb-alien:alien-sap events))
                        (count (hrt::epoll-wait-into epoll-fd 1000 sap 16))
                        (first (progn (hrt::queue-worker-tasks set (list task))
                                      (hrt::take-reported-tokens set sap count)))
                        (queued (remove task (hrt::readiness-set-tasks set))))
                   (is (eql 5 count) "one epoll_wait reports the four connections and the timer: ~S" count)
                   (is (eql hrt::+timer-token+ first) "the timer served first: ~S" first)
                   (is (= 4 (length queued)) "the four connections wait as tasks: ~S" queued)
                   (is (equal (list task) (remove-if #'integerp (hrt::readiness-set-tasks set)))
                       "after the task queued before them")
                   (hrt::run-due-timers set (hrt::engine-acceptor engine))
                   ;; The sweep, woken for the tasks while no worker is free,
                   ;; takes the queued connections as reported ones: each head
                   ;; complete, each waits for a worker under the queue timeout,
                   ;; queued again behind the function task for the busy ones.
                   (is-false (hrt::sweep-reported-token engine set hrt::+task-token+))
                   (is (eq task (first (hrt::readiness-set-tasks set))) "the function task stays for a worker")
                   (is (equal (sort (copy-list queued) #'<) (sort (remove task (hrt::readiness-set-tasks set)) #'<))
                       "the connections queued behind it: ~S" (hrt::readiness-set-tasks set))
                   (dolist (token queued)
                     (is (eql 503 (hrt::connection-timeout-status (connection-of token))))
                     (is (eq :parked (hrt::connection-state (connection-of token))))))))
          (loop while (hrt::pop-worker-task set))
          (mapc #'usocket:socket-close clients))))))

(test saturation.the-nudge-wakes-a-worker-only-for-tasks-held-up
  ;; Under steady load the queue is refilled as fast as it is served: a
  ;; nudge finding only tasks queued since it was armed wakes no worker.
  (with-engine-without-workers (engine set port)
    (let ((task-fd (hrt::readiness-set-task-fd set)))
      (flet ((queue (count)
               (hrt::queue-worker-tasks set (loop repeat count collect (lambda (serving) (declare (ignore serving))))))
             (take (count)
               (dotimes (index count) (is-true (hrt::pop-worker-task set))))
             (woken-p ()
               ;; Reading the eventfd clears it: true when it was signalled.
               (and (hrt::clear-timer-fd task-fd) t)))
        (woken-p)
        (queue 3)
        (take 3)
        (queue 2)
        (hrt::nudge-task-workers set)
        (is-false (woken-p) "the tasks older than the nudge were all taken")
        (is-true (hrt::readiness-set-task-nudge-p set) "armed again for the newer ones")
        (take 1)
        (hrt::nudge-task-workers set)
        (is-true (woken-p) "a task older than the nudge still waits")
        (is-false (hrt::readiness-set-task-nudge-p set))
        (take 1)
        ;; Tokens queued after a function and taken out of the queue by the
        ;; sweep: the function left counts as the newest, and waits one
        ;; nudge more at most.
        (queue 1)
        (hrt::queue-worker-tasks set (list 123456 123457))
        (is (equal '(123456 123457) (hrt::take-queued-tokens set)))
        (hrt::nudge-task-workers set)
        (is-false (woken-p))
        (hrt::nudge-task-workers set)
        (is-true (woken-p) "the function left waited two nudges")
        (take 1)
        (is (null (hrt::readiness-set-tasks set)))))))

(defun wait-on-set-through-signals (set milliseconds)
  "What one epoll_wait on SET's descriptor for MILLISECONDS reports (a count
of events, or :TIMEOUT), waited again for what is left of them when a
signal interrupts it: a collection in another thread stops this one so."
  (sb-alien:with-alien ((events (array (sb-alien:unsigned 8) #.(* 16 hrt::+epoll-event-bytes+))))
    (loop with deadline = (+ (get-internal-real-time) (* milliseconds (/ internal-time-units-per-second 1000)))
          for left = (max 0 (round (* 1000 (- deadline (get-internal-real-time))) internal-time-units-per-second))
          for outcome = (hrt::epoll-wait-into (hrt::readiness-set-epoll-fd set) left (sb-alien:alien-sap events) 16)
          unless (eq outcome :interrupted)
            return outcome)))

(test saturation.a-refused-listening-socket-is-reported-no-more
  ;; Hung up by a soft STOP, it would be reported to every wait until the
  ;; socket is closed, the workers spinning on it meanwhile.
  (with-engine-without-workers (engine set port)
    (hrt::stop-accepting set)
    (hrt::refuse-connections set)
    (signals usocket:connection-refused-error (usocket:socket-close (connect-to-port port)))
    (let ((outcome (wait-on-set-through-signals set 100)))
      (is (eq :timeout outcome) "the wait reported ~S" outcome))
    (hrt::sweep-while-no-worker-free engine set)
    (is (zerop (hrt::readiness-set-connection-count set)) "the sweep found nothing to take")))

(ht:define-easy-handler (test-busy-briefly :uri "/test/busy-briefly") ()
  (setf (ht:content-type*) "text/plain")
  ;; Busy for 0.8 ms: a quick request, after which the worker takes
  ;; several events from one wait.
  (loop with end = (+ (get-internal-real-time) (round (* 8/10000 internal-time-units-per-second)))
        until (>= (get-internal-real-time) end))
  "spun")

(test saturation.connections-reported-beside-a-held-one-are-answered-meanwhile
  ;; Both workers spin while one held request and eight quick ones arrive;
  ;; whichever worker then takes them in one wait holds the first and
  ;; leaves the rest queued, which the other worker must answer within the
  ;; nudge, not after the held handler.
  (with-readiness-server (server :taskmaster (two-worker-pool))
    (let ((spinners (loop repeat 2 collect (connect server)))
          (held (connect server))
          (quick (loop repeat 8 collect (connect server))))
      (setf *holding-released-p* nil)
      (unwind-protect
           (progn
             (dolist (socket (list* held (append spinners quick)))
               (send-text socket (get-request "/test/yo"))
               (is (eql 200 (read-response socket))))
             (is-true (connections-parked-p server 11))
             (dotimes (round 3)
               (dolist (socket spinners)
                 (send-text socket (get-request "/test/busy-briefly")))
               (send-text held (get-request "/test/hold"))
               (dolist (socket quick)
                 (send-text socket (get-request "/test/yo")))
               (let ((start (get-internal-real-time)))
                 (dolist (socket quick)
                   (is (eql 200 (read-response socket :timeout 5))))
                 (is (< (seconds-since start) 1) "the quick ones answered in ~,3F s while one is held"
                     (seconds-since start)))
               (setf *holding-released-p* t)
               (is (eql 200 (read-response held)))
               (dolist (socket spinners)
                 (is (eql 200 (read-response socket))))
               (setf *holding-released-p* nil)))
        (setf *holding-released-p* t)
        (mapc #'usocket:socket-close (list* held (append spinners quick)))))))
