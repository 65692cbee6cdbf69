;;;; STOP with everything under way at once: TLS handshakes that never
;;;; finish, TLS and plain requests whose handlers are running, kept-alive
;;;; and half-sent connections parked.  Every STOP must return within
;;;; :STOP-TIMEOUT, leave no thread and free the port.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite stop :in all :description "STOP under load, soft and hard, plain and TLS.")
(in-suite stop)

(defparameter *stop-rounds* 50
  "Rounds of the stress test; each stops a plain and an SSL acceptor.")

(defparameter *half-client-hello*
  (coerce #(22 3 1 0 200 1 0 0 196 3 3) '(vector (unsigned-byte 8)))
  "A TLS record header announcing a 200-octet ClientHello, and its first
octets: the server's handshake waits for the rest.")

(defvar *held-requests-released-p* nil
  "Set to let the handlers of /test/held return.")

(ht:define-easy-handler (test-held :uri "/test/held") ()
  ;; Held until released, so that every request is in flight at once however
  ;; slowly its client connects; given up after 10 s.
  (loop repeat 1000 until *held-requests-released-p* do (sleep 0.01))
  "released")

(defun port-free-p (port)
  "True when nothing listens on 127.0.0.1:PORT."
  (handler-case (progn (usocket:socket-close (usocket:socket-listen "127.0.0.1" port :reuse-address t))
                       t)
    (error () nil)))

(defun stress-server (ssl-p)
  (let ((taskmaster (make-instance 'recycling-taskmaster :standby-thread-count 4 :stop-timeout 5)))
    (if ssl-p
        (multiple-value-bind (certificate key) (certificate-files)
          (make-server 'parallel-easy-ssl-acceptor :taskmaster taskmaster
                                                   :ssl-certificate-file certificate
                                                   :ssl-privatekey-file key))
        (make-server 'parallel-easy-acceptor :taskmaster taskmaster))))

(defun park-kept-alive (server ssl-p)
  "A connection to SERVER that has had one request answered and is parked;
returns what to close."
  (if ssl-p
      (multiple-value-bind (stream socket) (tls-connect server)
        (write-sequence (flex:string-to-octets (get-request "/test/yo")) stream)
        (finish-output stream)
        (read-stream-response stream)
        socket)
      (let ((socket (connect server)))
        (send-text socket (get-request "/test/yo"))
        (read-response socket)
        socket)))

(defun load-for-stop (server ssl-p)
  "Put SERVER under every kind of work STOP must end.  Returns the sockets
of answered connections to close, those of connections whose first request
has not come yet (a partial head, a silent or half-done TLS handshake),
and the client threads to join."
  (let ((answered '())
        (unanswered '())
        (clients '()))
    (dotimes (i 2)
      (push (park-kept-alive server ssl-p) answered))
    (unless ssl-p
      (let ((socket (connect server)))
        (send-text socket (concatenate 'string (crlf-lines "GET /test/yo HTTP/1.1") "Host: lo"))
        (push socket unanswered)))
    (when ssl-p
      (dotimes (i 2)
        (push (connect server) unanswered))
      (dotimes (i 2)
        (let ((socket (connect server)))
          (write-sequence *half-client-hello* (usocket:socket-stream socket))
          (finish-output (usocket:socket-stream socket))
          (push socket unanswered))))
    (setf *held-requests-released-p* nil)
    (dotimes (i 3)
      (push (in-thread (lambda () (http-get server "/test/held" :verify nil))) clients))
    (is (wait-until (lambda () (= 3 (stats server :in-request-threads))))
        "three requests in flight before STOP of the ~:[plain~;SSL~] acceptor; its statistics: ~S"
        ssl-p (taskmaster-statistics server))
    (values answered unanswered clients)))

(defun stop-under-load (ssl-p soft-p)
  "One stressed STOP.  A soft STOP waits, up to half its stop timeout, for
the connections whose first request has not come: their clients leave once
it has begun, as the clients of a server going away do, so that it has
them to wait for and sees them go, without waiting out its deadline."
  (with-thread-leak-check ()
    (let* ((server (stress-server ssl-p))
           (port (progn (ht:start server) (ht:acceptor-port server))))
      (multiple-value-bind (answered unanswered clients) (load-for-stop server ssl-p)
        (flet ((close-sockets (sockets)
                 (dolist (socket sockets)
                   (ignore-errors (usocket:socket-close socket)))))
          (unwind-protect
               (let ((start (get-internal-real-time)))
                 (setf *held-requests-released-p* t)
                 (if soft-p
                     (let ((stop (in-thread (lambda ()
                                              (handler-case (progn (ht:stop server :soft t) :stopped)
                                                (error (condition) condition))))))
                       (close-sockets unanswered)
                       (is (equal '(:stopped) (funcall stop))))
                     (ht:stop server))
                 (let ((seconds (/ (- (get-internal-real-time) start) internal-time-units-per-second)))
                   (is (< seconds 5) "~:[hard~;soft~] STOP of the ~:[plain~;SSL~] acceptor took ~,2F s"
                       soft-p ssl-p seconds))
                 (is (= 0 (stats server :threads)))
                 (is (= 0 (stats server :open-connections)))
                 (is (port-free-p port) "the port is free")
                 (when soft-p
                   (is (every (lambda (join) (eql 200 (first (funcall join)))) clients)
                       "a soft STOP lets requests in flight finish")))
            (setf *held-requests-released-p* t)
            (mapc #'funcall clients)
            (close-sockets answered)
            (close-sockets unanswered)
            (when (ht:started-p server)
              (abandon-acceptor server))))))))

(test stop.connections-not-parked-once-either-flag-is-set
  ;; Hunchentoot's own STOP sets the acceptor's flag and waits for requests
  ;; in flight before it shuts the taskmaster down; ours sets both.  From
  ;; either, a connection whose request ends is closed, not parked.
  (with-server (server (make-server 'parallel-easy-acceptor))
    (let* ((taskmaster (ht::acceptor-taskmaster server))
           (set (hrt::engine-readiness-set (hrt::taskmaster-engine taskmaster))))
      (is (not (hrt::stopping-p set)))
      (unwind-protect
           (progn (setf (hrt::acceptor-shutting-down-p server) t)
                  (is (hrt::stopping-p set) "STOP has begun on the acceptor"))
        (setf (hrt::acceptor-shutting-down-p server) nil))
      (unwind-protect
           (progn (setf (hrt::shutting-down-p taskmaster) t)
                  (is (hrt::stopping-p set) "the taskmaster shuts down"))
        (setf (hrt::shutting-down-p taskmaster) nil))
      (is (not (hrt::stopping-p set)))
      (is (eql 200 (http-get server "/test/yo")) "served after"))))

(test stop.under-load-returns-within-the-stop-timeout
  (dotimes (round *stop-rounds*)
    (dolist (ssl-p '(nil t))
      (stop-under-load ssl-p (evenp round)))))

(ht:define-easy-handler (test-sleep-then-large :uri "/test/sleep-then-large") ()
  (sleep 0.3)
  (test-large))

(test stop.soft-stop-ends-with-a-request-whose-client-left
  ;; The handler's reply fails to go out; Hunchentoot logs that and the
  ;; request ends.
  (with-thread-leak-check ()
    (let ((server (pooled-server :standby-thread-count 2 :stop-timeout 5)))
      (ht:start server)
      (let ((socket (connect server)))
        (send-text socket (get-request "/test/sleep-then-large"))
        (is (wait-until (lambda () (= 1 (stats server :in-request-threads)))))
        (usocket:socket-close socket))
      (let ((start (get-internal-real-time)))
        (ht:stop server :soft t)
        (is (< (/ (- (get-internal-real-time) start) internal-time-units-per-second) 3)
            "the soft STOP ended with the failed request, well before its 5 s deadline"))
      (is (= 0 (stats server :threads))))))

(defun one-request-on-a-new-connection (port)
  ":SERVED when GET /test/yo on a new connection to PORT is answered 200,
:REFUSED when the connection is refused, else what happened instead."
  (handler-case
      (let ((socket (connect-to-port port)))
        (unwind-protect
             (progn (send-text socket (get-request "/test/yo"))
                    (let ((status (read-response socket :timeout 10)))
                      (if (eql status 200) :served (list :answered status))))
          (usocket:socket-close socket)))
    (usocket:connection-refused-error () :refused)
    (error (condition) condition)))

(test stop.soft-stop-refuses-new-connections-and-serves-accepted-ones
  ;; While a soft STOP waits for a request in flight and a connection that
  ;; has sent only the start of its request, a client connecting once the
  ;; socket has stopped listening is refused at once (ECONNREFUSED, which a
  ;; balancer retries elsewhere), never reset; the connection accepted
  ;; before is still served.  (A client that has sent nothing at all is not
  ;; accepted yet: see :DEFER-ACCEPT.)
  (with-thread-leak-check ()
    (let* ((server (pooled-server :standby-thread-count 2 :stop-timeout 10))
           (port (progn (ht:start server) (ht:acceptor-port server)))
           (outcomes '()))
      (setf *held-requests-released-p* nil)
      (let ((held (in-thread (lambda () (http-get server "/test/held"))))
            (waiting (connect server)))
        (unwind-protect
             (progn
               (send-text waiting "GET /test/yo HTTP/1.1")
               (is (wait-until (lambda () (= 1 (stats server :in-request-threads)))))
               (is (wait-until (lambda () (= 2 (stats server :open-connections)))))
               (let ((stop (in-thread (lambda () (ht:stop server :soft t)))))
                 ;; Until the socket stops listening a connection may still be
                 ;; taken and served; one made in the instant between the last
                 ;; accept and the shutdown is reset by the kernel (README).
                 (is (wait-until (lambda () (eq :refused (one-request-on-a-new-connection port)))))
                 (setf outcomes (loop repeat 20 collect (one-request-on-a-new-connection port)))
                 (send-text waiting (subseq (get-request "/test/yo") (length "GET /test/yo HTTP/1.1")))
                 (is (eql 200 (read-response waiting)) "the connection accepted before the STOP is served")
                 (setf *held-requests-released-p* t)
                 (is (eql 200 (first (funcall held))) "the request in flight is answered")
                 (funcall stop))
               (is (every (lambda (outcome) (eq outcome :refused)) outcomes)
                   "once the socket stopped listening, every connection was refused: ~S" outcomes)
               (is (port-free-p port)))
          (setf *held-requests-released-p* t)
          (usocket:socket-close waiting)
          (when (ht:started-p server)
            (abandon-acceptor server)))))))

(test stop.abandon-during-a-soft-stop-ends-both
  ;; ABANDON-ACCEPTOR is for when STOP cannot finish: called from another
  ;; thread while a soft STOP waits for a half-sent request, it ends the run,
  ;; and the STOP returns without an error.
  (with-thread-leak-check ()
    (let* ((server (pooled-server :standby-thread-count 2 :stop-timeout 10))
           (port (progn (ht:start server) (ht:acceptor-port server)))
           (half-sent (connect server)))
      (unwind-protect
           (progn
             (send-text half-sent "GET /test/yo HTTP/1.1")
             (is (wait-until (lambda () (= 1 (stats server :open-connections)))))
             (let ((stop (in-thread (lambda ()
                                      (handler-case (progn (ht:stop server :soft t) :returned)
                                        (error (condition) condition))))))
               (is (wait-until (lambda () (eq :refused (one-request-on-a-new-connection port))))
                   "the soft STOP has begun")
               (abandon-acceptor server)
               (is (eq :returned (first (funcall stop))))
               (is-false (ht:started-p server))
               (is (port-free-p port))))
        (usocket:socket-close half-sent)
        (when (ht:started-p server)
          (abandon-acceptor server))))))

(test stop.soft-stop-resets-a-client-that-has-sent-nothing
  ;; With :DEFER-ACCEPT (the default) a connection whose client has sent
  ;; nothing is still the kernel's: a soft STOP does not wait for it, and
  ;; the client's request, sent after the socket stopped listening, is
  ;; reset, as for a connection the kernel had not handed over.
  (with-thread-leak-check ()
    (let* ((server (pooled-server :standby-thread-count 2 :stop-timeout 10))
           (port (progn (ht:start server) (ht:acceptor-port server))))
      (setf *held-requests-released-p* nil)
      (let ((held (in-thread (lambda () (http-get server "/test/held"))))
            (silent (connect server)))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (= 1 (stats server :in-request-threads)))))
               (let ((stop (in-thread (lambda () (ht:stop server :soft t)))))
                 (is (wait-until (lambda () (eq :refused (one-request-on-a-new-connection port)))))
                 (is (member (handler-case (progn (send-text silent (get-request "/test/yo"))
                                                  (read-response silent :timeout 5))
                               (error () :reset))
                             '(nil :reset))
                     "the silent client's late request is not answered")
                 (setf *held-requests-released-p* t)
                 (is (eql 200 (first (funcall held))) "the request in flight is answered")
                 (funcall stop))
               (is (port-free-p port)))
          (setf *held-requests-released-p* t)
          (usocket:socket-close silent)
          (when (ht:started-p server)
            (abandon-acceptor server)))))))

(test stop.soft-stop-waits-for-a-connection-being-accepted
  ;; A worker woken for the listening socket just before a soft STOP stops
  ;; accepting takes its connection after STOP has looked at what it must
  ;; answer.  ENGINE-DRAIN waits for it; a thread that comes to the socket
  ;; after accepting stopped leaves it alone.
  (with-thread-leak-check ()
    (with-server (server (make-server 'parallel-easy-acceptor))
      (let* ((engine (hrt::taskmaster-engine (ht::acceptor-taskmaster server)))
             (set (hrt::engine-readiness-set engine))
             (inside (list nil))
             (release (list nil))
             (accepting (in-thread (lambda ()
                                     (hrt::when-accepting (set)
                                       (setf (car inside) t)
                                       (wait-until (lambda () (car release)) :timeout 30)
                                       :taken)))))
        (is (wait-until (lambda () (car inside))))
        (is (not (hrt::engine-drain engine (hrt::deadline-in 1/5)))
            "the drain ended while a thread was still taking a connection")
        (setf (car release) t)
        (is (equal '(:taken) (funcall accepting)) "a thread that began accepting finishes")
        (is (hrt::engine-drain engine (hrt::deadline-in 5)) "the drain ends once the thread has")
        (is (null (hrt::when-accepting (set) (error "accepted after accepting stopped"))))))))
