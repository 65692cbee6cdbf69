;;;; Running out of file descriptors: a server in a process of its own, with
;;;; a descriptor limit of 256 and its message log in a file, held 1,000
;;;; idle connections; it must stay alive and serve once they close.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite descriptor-limit :in all :description "EMFILE never ends the process.")
(in-suite descriptor-limit)

(defun server-program (port log-file)
  "The command-line options of a child SBCL that serves /yo on PORT, logging
to LOG-FILE, each read once the ones before it have run."
  (list "--load" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                            "tools/setup.lisp"))
        "--eval" "(asdf:load-system \"hunchentoot-recycling-taskmaster\")"
        "--eval" (format nil "(progn (hunchentoot:define-easy-handler (yo :uri \"/yo\") () \"Hey!\") ~
                   (hunchentoot:start (make-instance 'hunchentoot-recycling-taskmaster:parallel-easy-acceptor ~
                     :address \"127.0.0.1\" :port ~D :listen-backlog 2048 ~
                     :access-log-destination nil :message-log-destination ~S)) ~
                   (loop (sleep 1)))"
                         port (namestring log-file))))

(defun start-limited-server (port log-file descriptor-limit)
  "A child SBCL serving on PORT with DESCRIPTOR-LIMIT open files; its process-info."
  (uiop:launch-program
   (list* "sh" "-c" (format nil "ulimit -n ~D && exec sbcl --noinform --non-interactive --disable-debugger \"$@\""
                            descriptor-limit)
          "server" (server-program port log-file))
   :output nil :error-output nil))

(defun get-yo (port)
  "The status of GET /yo on 127.0.0.1:PORT, or NIL."
  (handler-case
      (bt:with-timeout (10)
        (nth-value 1 (drakma:http-request (format nil "http://127.0.0.1:~D/yo" port) :connection-timeout 5)))
    (serious-condition () nil)))

(test emfile.idle-connections-past-the-limit-leave-the-server-alive
  (let* ((port (free-port))
         (log-file (uiop:with-temporary-file (:pathname path :keep t) path))
         (server (start-limited-server port log-file 256))
         (sockets '()))
    (unwind-protect
         (progn
           (is (wait-until (lambda () (eql 200 (get-yo port))) :timeout 60) "the server starts")
           ;; Each sends the first octet of a head: the kernel hands over
           ;; only connections whose client has spoken (:DEFER-ACCEPT).
           (setf sockets (loop repeat 1000
                               collect (ignore-errors (let ((socket (connect-to-port port)))
                                                        (send-text socket "G")
                                                        socket))))
           (is (= 1000 (count-if-not #'null sockets)) "1,000 connections made (the kernel's backlog holds the rest)")
           (sleep 2)
           (is (uiop:process-alive-p server) "alive with 1,000 idle connections at a limit of 256")
           (dolist (socket sockets)
             (when socket (ignore-errors (usocket:socket-close socket))))
           (setf sockets '())
           (is (wait-until (lambda () (eql 200 (get-yo port))) :timeout 20)
               "serving again once the connections closed")
           (is (uiop:process-alive-p server))
           (is (search "accept failed" (uiop:read-file-string log-file))
               "the pause was logged once a descriptor was free to log it"))
      (dolist (socket sockets)
        (when socket (ignore-errors (usocket:socket-close socket))))
      (uiop:terminate-process server)
      (uiop:wait-process server)
      (ignore-errors (delete-file log-file)))))
