;;;; Deferred replies and the engine's timer: a handler that returns
;;;; without its reply frees its worker; any thread completes the reply
;;;; once; the timeout, the client hanging up, a failing handler and STOP
;;;; each settle it as documented.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite deferred-replies :in all :description "Replies that wait without a thread.")
(in-suite deferred-replies)

(defvar *last-deferred* nil
  "The DEFERRED-REPLY the last /test/deferred/... handler made.")

(defvar *client-gone-calls* 0)

(ht:define-easy-handler (test-deferred-timer :uri "/test/deferred/timer") ((ms :parameter-type 'integer))
  (let ((deferred (defer-reply)))
    (call-after (or ms 0) (lambda ()
                            (complete-reply deferred :status ht:+http-created+ :content-type "text/plain"
                                                     :headers '((:x-waited . "yes"))
                                                     :body (format nil "waited ~D ms" ms))))
    "never sent"))

(ht:define-easy-handler (test-deferred-thread :uri "/test/deferred/thread") ()
  (let ((deferred (defer-reply)))
    (bt:make-thread (lambda () (sleep 0.05) (complete-reply deferred :body "from a thread"))
                    :name "test completer")
    nil))

(ht:define-easy-handler (test-deferred-never :uri "/test/deferred/never") ((status :parameter-type 'integer))
  (setf *last-deferred* (defer-reply :timeout 0.5 :timeout-status (or status 503)
                                     :on-client-gone (lambda (deferred)
                                                       (declare (ignore deferred))
                                                       (incf *client-gone-calls*))))
  nil)

(ht:define-easy-handler (test-deferred-then-error :uri "/test/deferred/then-error") ()
  (setf *last-deferred* (defer-reply))
  (error "failed after deferring"))

(ht:define-easy-handler (test-deferred-now :uri "/test/deferred/now") ()
  "not deferred")

(defun deferring-server ()
  (pooled-server :standby-thread-count 2 :max-thread-count 4 :stop-timeout 5))

(test deferred-reply.completed-by-the-timer
  (with-server (server (deferring-server))
    (multiple-value-bind (body status headers) (drakma:http-request (url server "/test/deferred/timer?ms=50"))
      (is (eql 201 status))
      (is (equal "waited 50 ms" body))
      (is (equal "yes" (cdr (assoc :x-waited headers))))
      (is (search "text/plain" (cdr (assoc :content-type headers)))))))

(test deferred-reply.completed-by-another-thread
  (with-server (server (deferring-server))
    (multiple-value-bind (status body) (http-get server "/test/deferred/thread")
      (is (eql 200 status))
      (is (equal "from a thread" body)))))

(test deferred-reply.waits-holding-no-worker
  ;; 200 replies waiting at once on at most 4 workers, all answered.
  (with-server (server (deferring-server))
    (let* ((sockets (loop repeat 200 collect (connect server))))
      (unwind-protect
           (progn
             (dolist (socket sockets)
               (send-text socket (crlf-lines "GET /test/deferred/timer?ms=1500 HTTP/1.1" "Host: x" "" "")))
             (is (wait-until (lambda () (>= (or (stats server :deferred-replies) 0) 200)) :timeout 5)
                 "~D replies deferred" (stats server :deferred-replies))
             (is (<= (stats server :threads) 4))
             (is (= 200 (count 201 (mapcar #'read-response sockets)))))
        (mapc #'usocket:socket-close sockets)))))

(test deferred-reply.keeps-the-connection-and-the-order-of-replies
  (with-server (server (deferring-server))
    (let ((socket (connect server)))
      (unwind-protect
           (progn
             (send-text socket (concatenate 'string
                                            (crlf-lines "GET /test/deferred/timer?ms=100 HTTP/1.1" "Host: x" "" "")
                                            (crlf-lines "GET /test/deferred/now HTTP/1.1" "Host: x" "" "")))
             (multiple-value-bind (status body) (read-response socket)
               (is (eql 201 status))
               (is (equal "waited 100 ms" body)))
             (multiple-value-bind (status body) (read-response socket)
               (is (eql 200 status))
               (is (equal "not deferred" body)))
             (send-text socket (crlf-lines "GET /test/deferred/timer?ms=10 HTTP/1.1" "Host: x" "" ""))
             (is (eql 201 (read-response socket))))
        (usocket:socket-close socket)))))

(test deferred-reply.answered-at-its-timeout-and-completed-no-more
  (with-server (server (deferring-server))
    (is (eql 503 (http-get server "/test/deferred/never")))
    (is (eql 504 (http-get server "/test/deferred/never?status=504")))
    (is (not (reply-pending-p *last-deferred*)))
    (is (null (complete-reply *last-deferred* :body "late")))
    (is (= 2 (stats server :deferred-reply-timeouts)))))

(test deferred-reply.completed-once
  (with-server (server (deferring-server))
    (let ((socket (connect server)))
      (unwind-protect
           (progn
             (setf *last-deferred* nil)
             (send-text socket (crlf-lines "GET /test/deferred/never HTTP/1.1" "Host: x" "" ""))
             (is (wait-until (lambda () *last-deferred*)))
             (is (eq t (complete-reply *last-deferred* :body "first")))
             (is (null (complete-reply *last-deferred* :body "second")))
             (multiple-value-bind (status body) (read-response socket)
               (is (eql 200 status))
               (is (equal "first" body))))
        (usocket:socket-close socket)))))

(test deferred-reply.client-gone-noticed
  (with-server (server (deferring-server))
    (let ((socket (connect server))
          (calls *client-gone-calls*))
      (setf *last-deferred* nil)
      (send-text socket (crlf-lines "GET /test/deferred/never HTTP/1.1" "Host: x" "" ""))
      (is (wait-until (lambda () *last-deferred*)))
      (reset-socket socket)
      (is (wait-until (lambda () (reply-client-gone-p *last-deferred*)) :timeout 2))
      (is (wait-until (lambda () (= (1+ calls) *client-gone-calls*)) :timeout 2))
      (is (null (complete-reply *last-deferred* :body "nobody there")))
      (is (wait-until (lambda () (eql 1 (stats server :deferred-clients-gone))))))))

(test deferred-reply.failing-handler-answers-500
  (with-server (server (deferring-server))
    (is (eql 500 (http-get server "/test/deferred/then-error")))
    (is (null (complete-reply *last-deferred* :body "too late")))
    (is (eql 0 (stats server :deferred-replies)))))

(test deferred-reply.outside-a-handler-is-refused
  (signals reply-not-deferrable (defer-reply)))

(test deferred-reply.soft-stop-waits-for-it
  (let ((server (deferring-server)))
    (ht:start server)
    (let ((socket (connect server)))
      (unwind-protect
           (progn
             (send-text socket (crlf-lines "GET /test/deferred/timer?ms=300 HTTP/1.1" "Host: x" "" ""))
             (is (wait-until (lambda () (eql 1 (stats server :deferred-replies)))))
             (let ((stopped (in-thread (lambda () (ht:stop server :soft t)))))
               (is (eql 201 (read-response socket)))
               (funcall stopped))
             (is (not (ht:started-p server))))
        (usocket:socket-close socket)))))

(test call-after.calls-in-order-and-cancel-call-prevents
  (with-server (server (deferring-server))
    (let ((calls '())
          (lock (bt:make-lock)))
      (flet ((note (what) (lambda () (bt:with-lock-held (lock) (push what calls)))))
        (call-after 60 (note :third) :acceptor server)
        (call-after 20 (note :second) :acceptor server)
        (call-after 0 (note :first) :acceptor server)
        (cancel-call (call-after 40 (note :cancelled) :acceptor server))
        (is (wait-until (lambda () (= 3 (length calls)))))
        (sleep 0.1)
        (is (equal '(:first :second :third) (reverse calls)))))))

(test call-after.error-in-a-timer-is-logged-and-harmless
  (with-server (server (deferring-server))
    (call-after 0 (lambda () (error "a timer fails")) :acceptor server)
    (is (eql 201 (http-get server "/test/deferred/timer?ms=1")))))

(test deferred-reply.over-tls
  (with-server (server (tls-server))
    (dotimes (i 3)
      (multiple-value-bind (status body) (http-get server "/test/deferred/timer?ms=20" :verify nil)
        (is (eql 201 status))
        (is (equal "waited 20 ms" body))))))

(test deferred-reply.request-sent-while-it-waits-is-answered-after-it
  (with-server (server (deferring-server))
    (let ((socket (connect server)))
      (unwind-protect
           (progn
             (send-text socket (crlf-lines "GET /test/deferred/timer?ms=400 HTTP/1.1" "Host: x" "" ""))
             (is (wait-until (lambda () (eql 1 (stats server :deferred-replies)))))
             (send-text socket (crlf-lines "GET /test/deferred/now HTTP/1.1" "Host: x" "" ""))
             (multiple-value-bind (status body) (read-response socket)
               (is (eql 201 status))
               (is (equal "waited 400 ms" body)))
             (multiple-value-bind (status body) (read-response socket)
               (is (eql 200 status))
               (is (equal "not deferred" body))))
        (usocket:socket-close socket)))))

;;; A client that half-closes after its request (shutdown(SHUT_WR), as nc -N
;;; and some proxies do) still gets its reply, then the close: only a
;;; reset or a failed write means it left (RFC 9112 9.6).

(defun half-closed-requests (server path count)
  "COUNT sockets that sent SERVER the request PATH, then shut down their
side of the connection."
  (loop repeat count
        collect (let ((socket (connect server)))
                  (send-text socket (crlf-lines (format nil "GET ~A HTTP/1.1" path) "Host: x" ""))
                  (sb-bsd-sockets:socket-shutdown (usocket:socket socket) :direction :output)
                  socket)))

(test deferred-reply.half-closed-clients-get-their-reply-then-the-close
  (with-server (server (deferring-server))
    (let* ((sockets (half-closed-requests server "/test/deferred/timer?ms=2000" 1000))
           (readers (start-octets-readers sockets)))
      (unwind-protect
           (progn
             (is (wait-until (lambda () (every #'octets-reader-ended-p readers)) :timeout 30)
                 "every connection closed by the server after its reply")
             (is (= 1000 (count 201 readers :key #'octets-reader-status))
                 "each got its reply: ~D of 1,000" (count 201 readers :key #'octets-reader-status)))
        (mapc #'usocket:socket-close sockets))
      (is (wait-until (lambda () (eql 0 (stats server :deferred-replies)))))
      (is (eql 0 (stats server :deferred-clients-gone)) "none counted gone"))))

(test deferred-reply.half-closed-tls-clients-get-their-reply
  (with-server (server (tls-server))
    (let ((clients (loop repeat 1000
                         collect (multiple-value-bind (stream socket) (tls-connect server)
                                   (write-sequence (flex:string-to-octets
                                                    (crlf-lines "GET /test/deferred/timer?ms=2000 HTTP/1.1" "Host: x" "")
                                                    :external-format :latin-1)
                                                   stream)
                                   (finish-output stream)
                                   (sb-bsd-sockets:socket-shutdown (usocket:socket socket) :direction :output)
                                   (cons stream socket)))))
      (unwind-protect
           (progn
             (is (= 1000 (count 201 clients :key (lambda (client)
                                                   (handler-case (read-stream-response (car client))
                                                     (error () nil)))))
                 "each half-closed TLS client got its reply")
             (is (wait-until (lambda () (eql 0 (stats server :open-connections))) :timeout 30)
                 "then each connection closed by the server: ~D open" (stats server :open-connections)))
        (loop for (stream . socket) in clients
              do (ignore-errors (close stream))
                 (usocket:socket-close socket)))
      (is (wait-until (lambda () (eql 0 (stats server :deferred-replies))))))))

(test deferred-reply.over-http2
  ;; On an HTTP/2 stream as on HTTP/1.1: completed by the timer or another
  ;; thread, answered at its timeout, 500 when its handler fails after
  ;; deferring; over h2c and h2.
  (dolist (make-server (list #'http2-server #'http2-ssl-server))
    (with-server (server (funcall make-server :taskmaster (make-instance 'recycling-taskmaster
                                                                         :standby-thread-count 2
                                                                         :max-thread-count 4 :stop-timeout 5)))
      (let ((protocol (if (ht:acceptor-ssl-p server) :h2 :h2c)))
        (multiple-value-bind (status headers body) (curl-reply (url server "/test/deferred/timer?ms=50") protocol)
          (is (equal '(201 "yes" "waited 50 ms")
                     (list status (cdr (assoc "x-waited" headers :test #'string=)) body))
              "~A: ~S ~S ~S" protocol status headers body))
        (is (equal '(200 "from a thread")
                   (multiple-value-bind (status headers body) (curl-reply (url server "/test/deferred/thread") protocol)
                     (declare (ignore headers))
                     (list status body))))
        (is (eql 504 (curl-reply (url server "/test/deferred/never?status=504") protocol)))
        (is (null (complete-reply *last-deferred* :body "late")))
        (is (eql 500 (curl-reply (url server "/test/deferred/then-error") protocol)))
        (is (null (complete-reply *last-deferred* :body "too late")))
        (is (eql 1 (stats server :deferred-reply-timeouts)))
        (is (wait-until (lambda () (eql 0 (stats server :deferred-replies)))) "none left counted")))))

(test deferred-reply.many-on-http2-hold-no-worker
  ;; 1,000 streams on 10 connections wait at once, with the pool's standby
  ;; workers only; every one answered.
  (with-server (server (http2-server :taskmaster (make-instance 'recycling-taskmaster :standby-thread-count 2
                                                                                     :max-thread-count 4)))
    (let* ((join (in-thread (lambda () (h2load (url server "/test/deferred/timer?ms=2000")
                                               "-n" "1000" "-c" "10" "-m" "100")))))
      (is (wait-until (lambda () (eql 1000 (stats server :deferred-replies))) :timeout 30)
          "1,000 waiting at once: ~D" (stats server :deferred-replies))
      (is (<= (stats server :threads) 4) "~D workers" (stats server :threads))
      (destructuring-bind (succeeded failed seconds) (funcall join)
        (declare (ignore seconds))
        (is (eql 1000 succeeded) "~D answered, ~D failed" succeeded failed)))
    (is (wait-until (lambda () (eql 0 (stats server :deferred-replies)))))))

(test deferred-reply.on-http2-client-gone-noticed
  ;; A client that hangs up while its stream's reply is deferred: the reply
  ;; settled :GONE and its ON-CLIENT-GONE called.
  (with-server (server (http2-server))
    (let ((calls *client-gone-calls*))
      (setf *last-deferred* nil)
      (uiop:run-program (list "curl" "-s" "--http2-prior-knowledge" "-m" "0.3" (url server "/test/deferred/never"))
                        :ignore-error-status t)
      (is (wait-until (lambda () (and *last-deferred* (reply-client-gone-p *last-deferred*))) :timeout 5))
      (is (wait-until (lambda () (= (1+ calls) *client-gone-calls*)) :timeout 5))
      (is (null (complete-reply *last-deferred* :body "nobody there")))
      (is (wait-until (lambda () (eql 1 (stats server :deferred-clients-gone)))))
      (is (wait-until (lambda () (eql 0 (stats server :deferred-replies))))))))

(test deferred-reply.on-http2-waits-past-the-read-timeout-and-a-soft-stop-waits-for-it
  ;; Its stream open and no handler running, its connection is held for
  ;; the reply's own timeout, not the connection's read timeout; a soft
  ;; STOP sends it before it stops, as on HTTP/1.1.
  (with-server (server (http2-server :read-timeout 1 :write-timeout 1))
    (is (equal '(201 "waited 2000 ms")
               (multiple-value-bind (status headers body) (curl-reply (url server "/test/deferred/timer?ms=2000") :h2c)
                 (declare (ignore headers))
                 (list status body)))))
  (let ((server (http2-server)))
    (ht:start server)
    (let ((reply (in-thread (lambda () (curl-reply (url server "/test/deferred/timer?ms=300") :h2c)))))
      (is (wait-until (lambda () (eql 1 (stats server :deferred-replies)))))
      (ht:stop server :soft t)
      (is (eql 201 (first (funcall reply))) "answered before the stop"))
    (is (not (ht:started-p server)))))
