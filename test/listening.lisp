;;;; Listening sockets: several processes on one port with :REUSE-PORT, and
;;;; an inherited listening descriptor that STOP and ABANDON-ACCEPTOR leave
;;;; listening.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite listening :in all :description "SO_REUSEPORT and inherited listening sockets.")
(in-suite listening)

(ht:define-easy-handler (test-pid :uri "/test/pid") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (sb-unix:unix-getpid)))

(defun start-reuse-port-child (port)
  "A child SBCL serving /test/pid, its own PID, on PORT with :REUSE-PORT."
  (uiop:launch-program
   (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
         "--load" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                             "tools/setup.lisp"))
         "--eval" "(asdf:load-system \"hunchentoot-recycling-taskmaster\")"
         "--eval" (format nil "(progn (hunchentoot:define-easy-handler (pid :uri \"/test/pid\") () ~
                                        (princ-to-string (sb-unix:unix-getpid))) ~
                                      (hunchentoot:start (make-instance ~
                                        'hunchentoot-recycling-taskmaster:parallel-easy-acceptor ~
                                        :address \"127.0.0.1\" :port ~D :reuse-port t ~
                                        :access-log-destination nil :message-log-destination nil)) ~
                                      (sleep 120))"
                          port))
   :output nil :error-output nil))

(defun pid-of-answer (port)
  "The PID that GET /test/pid on a new connection to PORT answers, or NIL."
  (handler-case
      (bt:with-timeout (10)
        (multiple-value-bind (body status)
            (drakma:http-request (format nil "http://127.0.0.1:~D/test/pid" port) :connection-timeout 5)
          (and (eql status 200) (parse-integer body :junk-allowed t))))
    (serious-condition () nil)))

(test listening.reuse-port-shares-a-port-between-processes
  (with-server (server (make-server 'parallel-easy-acceptor :reuse-port t))
    (let* ((port (ht:acceptor-port server))
           (our-pid (sb-unix:unix-getpid))
           (child (start-reuse-port-child port)))
      (unwind-protect
           (let ((child-pid (uiop:process-info-pid child)))
             ;; The child takes a share of the port once it listens.
             (is (wait-until (lambda () (eql child-pid (pid-of-answer port))) :timeout 60 :interval 0.2)
                 "the child process answers on the shared port")
             (let ((pids (loop repeat 200 collect (pid-of-answer port))))
               (is (notany #'null pids) "every request answered")
               (is (member our-pid pids) "this process answered some of 200 requests")
               (is (member child-pid pids) "the child answered some of 200 requests")))
        (uiop:terminate-process child :urgent t)
        (uiop:wait-process child)))))

(test listening.port-in-use-without-reuse-port
  (with-server (server (make-server 'parallel-easy-acceptor :reuse-port t))
    (let ((other (make-server 'parallel-easy-acceptor :port (ht:acceptor-port server))))
      (signals usocket:address-in-use-error (ht:start other))
      (is (eql 200 (http-get server "/test/yo")) "the first acceptor still serves"))))

(defun listening-fd (socket)
  (sb-bsd-sockets:socket-file-descriptor (usocket:socket socket)))

(defun accepting-deferred-seconds (server)
  "SERVER's listening socket's TCP_DEFER_ACCEPT, as the kernel keeps it: 0
when accepting is not deferred."
  (hunchentoot-recycling-taskmaster::socket-option
   (listening-fd (hunchentoot-recycling-taskmaster::acceptor-listen-socket server))
   hunchentoot-recycling-taskmaster::+tcp-defer-accept+
   hunchentoot-recycling-taskmaster::+ipproto-tcp+))

(defun silent-client-accepted-p (server)
  "Connect to SERVER and send nothing, then serve a request on another
connection: true when SERVER had accepted the silent one by then."
  (let ((silent (connect server)))
    (unwind-protect
         (progn
           (is (eql 200 (http-get server "/test/yo")))
           ;; The kernel queues connections in order: the silent one, if it
           ;; is to be handed over at once, was handed over before drakma's.
           (is (wait-until (lambda () (<= 1 (stats server :requests-served)))))
           (let ((accepted-p (= 2 (stats server :connections-accepted))))
             (send-text silent (crlf-lines "GET /test/yo HTTP/1.1" "Host: x" "Connection: close" ""))
             (is (eql 200 (read-response silent)) "the silent client is served once it speaks")
             (is (= 2 (stats server :connections-accepted)))
             accepted-p))
      (usocket:socket-close silent))))

(test listening.accepting-waits-for-the-first-bytes
  (with-server (server (make-server 'parallel-easy-acceptor :header-timeout 7))
    (is (<= 7 (accepting-deferred-seconds server)) "TCP_DEFER_ACCEPT covers the header timeout")
    (is-false (silent-client-accepted-p server) "a client that has sent nothing is not accepted")))

(test listening.accepting-at-once-without-defer-accept
  (with-server (server (make-server 'parallel-easy-acceptor :defer-accept nil))
    (is (zerop (accepting-deferred-seconds server)))
    (is-true (silent-client-accepted-p server) "a client that has sent nothing is accepted")))

(test listening.inherited-descriptor-is-served-and-left-listening
  (let* ((socket (usocket:socket-listen "127.0.0.1" 0 :reuse-address t :backlog 128
                                                      :element-type '(unsigned-byte 8)))
         (fd (listening-fd socket))
         (port (usocket:get-local-port socket)))
    (unwind-protect
         (flet ((serve-once (stop)
                  (with-thread-leak-check ()
                    (let ((server (make-server 'parallel-easy-acceptor :listen-fd fd)))
                      (ht:start server)
                      (unwind-protect
                           (progn
                             (is (= port (ht:acceptor-port server)) "the port is read from the descriptor")
                             (is (eql 200 (first (multiple-value-list (http-get server "/test/yo"))))))
                        (funcall stop server))))
                  ;; Still listening, also once the acceptor's socket object
                  ;; is garbage: the kernel completes a connection to it.
                  (sb-ext:gc :full t)
                  (let ((client (connect-to-port port)))
                    (is-true client "a connection is accepted into the backlog after the acceptor stopped")
                    (usocket:socket-close client))))
           (serve-once #'ht:stop)
           (serve-once #'abandon-acceptor)
           (serve-once #'ht:stop))
      (usocket:socket-close socket))))

(test listening.inherited-descriptor-must-listen
  (let ((server (make-server 'parallel-easy-acceptor :listen-fd 0)))
    (signals invalid-acceptor-configuration (ht:start server))))

(defun demo-under-socket-activation (port output-file)
  "The demo started as its systemd unit starts it, on a socket that
systemd-socket-activate listens on at PORT and passes on the first
connection; its output goes to OUTPUT-FILE."
  (uiop:launch-program
   (list "systemd-socket-activate" "-l" (format nil "127.0.0.1:~D" port)
         "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
         "--load" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                             "tools/setup.lisp"))
         "--eval" "(asdf:load-system \"hunchentoot-recycling-taskmaster/demo\")"
         "--eval" "(hunchentoot-recycling-taskmaster-demo:main)")
   :output output-file :if-output-exists :supersede :error-output :output))

(test listening.demo-under-socket-activation-serves-and-exits-0-on-sigterm
  (let ((port (free-port))
        (output (uiop:with-temporary-file (:pathname path :keep t) path)))
    (unwind-protect
         (let ((demo (demo-under-socket-activation port output)))
           (unwind-protect
                (progn
                  (is (wait-until (lambda () (ignore-errors (usocket:socket-close (connect-to-port port)) t))
                                  :timeout 10)
                      "systemd-socket-activate listens")
                  ;; The first request starts the demo, which finds it in the backlog.
                  (multiple-value-bind (body status)
                      (handler-case (bt:with-timeout (90)
                                      (drakma:http-request (format nil "http://127.0.0.1:~D/yo" port)
                                                           :connection-timeout 10))
                        (serious-condition () nil))
                    (is (eql 200 status) "the demo answers on the passed socket")
                    (is (equal "Hey!" body)))
                  (is (search "the socket systemd passed" (uiop:read-file-string output))
                      "the demo served the passed descriptor: ~S" (uiop:read-file-string output))
                  (uiop:terminate-process demo)
                  (is (eql 0 (uiop:wait-process demo)) "SIGTERM ends the demo with exit code 0")
                  (is (search "SIGTERM: stopped after" (uiop:read-file-string output))))
             (when (uiop:process-alive-p demo)
               (uiop:terminate-process demo :urgent t)
               (uiop:wait-process demo))))
      (ignore-errors (delete-file output)))))

(defun get-yo-on-new-connection (port)
  "The status of GET /test/yo on a new connection to PORT, or NIL."
  (handler-case
      (let ((socket (connect-to-port port)))
        (unwind-protect
             (progn (send-text socket (get-request "/test/yo" "Connection: close"))
                    (read-response socket :timeout 10))
          (ignore-errors (usocket:socket-close socket))))
    (error () nil)))

(defun check-restarts-lose-no-request (port start-one)
  "Serve 2,000 requests from 20 clients on PORT while the acceptor
START-ONE starts is restarted 4 times: the next one started, then the old
one stopped softly.  Check that every request was answered 200."
  (let* ((serving (funcall start-one))
         (clients (loop repeat 20
                        collect (in-thread (lambda ()
                                             (loop repeat 100
                                                   count (eql 200 (get-yo-on-new-connection port))))))))
    (dotimes (restart 4)
      (sleep 0.3)
      (let ((next (funcall start-one)))
        (ht:stop serving :soft t)
        (setf serving next)))
    (let ((answered (reduce #'+ clients :key (lambda (client) (first (funcall client))))))
      (is (= 2000 answered) "~D of 2,000 requests answered 200 across 4 restarts" answered))
    (ht:stop serving :soft t)))

(defmacro with-listening-socket ((fd port) &body body)
  "Run BODY with FD and PORT a listening socket's descriptor and port, closed afterwards."
  (let ((socket (gensym "SOCKET")))
    `(let* ((,socket (usocket:socket-listen "127.0.0.1" 0 :reuse-address t :backlog 1024
                                                          :element-type '(unsigned-byte 8)))
            (,fd (listening-fd ,socket))
            (,port (usocket:get-local-port ,socket)))
       (unwind-protect (progn ,@body)
         (usocket:socket-close ,socket)))))

(test listening.restart-on-an-inherited-socket-loses-no-request
  (with-listening-socket (fd port)
    (with-thread-leak-check ()
      (check-restarts-lose-no-request
       port (lambda () (ht:start (make-server 'parallel-easy-acceptor :listen-fd fd)))))))

(defclass given-socket-acceptor (parallel-easy-acceptor)
  ((listening-fd :initarg :listening-fd :reader given-listening-fd))
  (:documentation "An application's acceptor whose own START-LISTENING
method serves a copy of a descriptor that listens already, as a supervisor
handing its socket to each new process does."))

(defmethod ht:start-listening ((acceptor given-socket-acceptor))
  (setf (hrt::acceptor-listen-socket acceptor)
        (hrt::adopt-listening-descriptor (sb-unix:unix-dup (given-listening-fd acceptor)))))

(test listening.socket-given-by-start-listening-still-listens-after-a-soft-stop
  (with-listening-socket (fd port)
    (with-thread-leak-check ()
      (flet ((start-one () (ht:start (make-server 'given-socket-acceptor :listening-fd fd))))
        (check-restarts-lose-no-request port #'start-one)
        (let ((serving (start-one)))
          (is (eql 200 (unwind-protect (get-yo-on-new-connection port)
                         (ht:stop serving :soft t)))
              "the socket still listens after the last soft stop"))))))

(test listening.connections-inherit-tcp-nodelay
  ;; Nagle's algorithm would hold the replies to pipelined requests after
  ;; the first for the client's delayed acknowledgement, 40 ms.
  (dolist (initargs '(() (:reuse-port t)))
    (with-server (server (apply #'make-server 'parallel-easy-acceptor initargs))
      (is (eql 1 (hunchentoot-recycling-taskmaster::socket-option
                  (listening-fd (hunchentoot-recycling-taskmaster::acceptor-listen-socket server))
                  hunchentoot-recycling-taskmaster::+tcp-nodelay+
                  hunchentoot-recycling-taskmaster::+ipproto-tcp+))
          "TCP_NODELAY on the listening socket~@[ ~S~]" initargs))))
