;;;; Overload: more clients than threads.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite overload :in all :description "More clients than the pool has threads.")
(in-suite overload)

(defun connect-all (server count)
  (loop repeat count
        collect (handler-case (connect server)
                  (error () nil))))

(defun collect-responses (sockets timeout)
  "For each socket, the status of the first complete response read within
TIMEOUT seconds overall, or NIL.  Polls with LISTEN: select(2) cannot take
the descriptors past 1024 that a thousand sockets reach."
  (let* ((count (length sockets))
         (buffers (loop repeat count
                        collect (make-array 0 :element-type '(unsigned-byte 8)
                                              :adjustable t :fill-pointer t)))
         (statuses (make-list count))
         (deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second))))
    (loop
      (let ((progress nil))
        (loop for socket in sockets
              for buffer in buffers
              for cell on statuses
              when (and socket (null (car cell)))
                do (let ((stream (usocket:socket-stream socket)))
                     (handler-case
                         (loop while (listen stream)
                               do (vector-push-extend (read-byte stream) buffer)
                                  (setf progress t))
                       (error () nil))
                     (when (response-complete-p buffer)
                       (setf (car cell) (parse-integer (map 'string #'code-char (subseq buffer 9 12)))))))
        (when (or (notany #'null statuses)
                  (> (get-internal-real-time) deadline))
          (return statuses))
        (unless progress (sleep 0.005))))))

(test overload.thousand-keep-alive-clients-all-answered
  (with-thread-leak-check ()
    (with-server (server (make-server 'parallel-easy-acceptor))
      (let ((sockets (connect-all server 1000)))
        (unwind-protect
             (progn
               (is (= 1000 (count-if-not #'null sockets)) "every client connected")
               (dolist (socket sockets)
                 (when socket
                   (ignore-errors
                    (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" "")))))
               (let ((statuses (collect-responses sockets 60)))
                 (is (= 1000 (count 200 statuses))
                     "~D of 1000 clients answered 200: connections past the thread limit ~
                      wait for a worker, none is refused"
                     (count 200 statuses))
                 (is (<= (stats server :peak-threads) 100))))
          (dolist (socket sockets)
            (when socket (ignore-errors (usocket:socket-close socket)))))))))
