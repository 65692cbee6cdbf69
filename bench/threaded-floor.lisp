;;;; The threaded floor: what any server that gives each handler in flight
;;;; a thread of its own can do on this machine.  THREAD-COUNT threads wait
;;;; on one epoll set holding the listening socket and every connection
;;;; (one-shot, armed again after each reply); the thread woken reads what
;;;; came, sleeps the handler's delay, and sends a fixed reply.  No HTTP is
;;;; parsed, no request object made, no log written: only the system calls
;;;; and the thread switches that a handler which blocks costs, made with
;;;; the engine's own calls (src/sys/).  `bench/run threaded-floor`
;;;; measures it beside ours and nginx, so that a cell ours cannot reach
;;;; shows whether threads can.
;;;;
;;;; It answers wrk's requests only: each read is taken to be one whole GET
;;;; (wrk sends one at a time, with no body), and a request naming
;;;; "Connection: close" is answered so and closed.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun floor-reply (close)
  "The fixed reply of the threaded floor: ours' reply to /yo without its
Date, Server and Keep-Alive headers."
  (flex:string-to-octets
   (format nil "HTTP/1.1 200 OK~C~CContent-Length: 4~C~CContent-Type: text/plain~C~C~:[~;Connection: close~C~C~]~C~CHey!"
           #\Return #\Newline #\Return #\Newline #\Return #\Newline close #\Return #\Newline #\Return #\Newline)
   :external-format :latin-1))

(defparameter *floor-close-request-marker* (flex:string-to-octets "Connection: close" :external-format :latin-1))

(defun serve-floor-connection (epoll-fd fd buffer answer keep-alive-reply close-reply)
  "Answer the request that arrived on FD: call ANSWER with BUFFER and the
count of octets read into it, send the fixed reply, then arm FD again, or
close it."
  (let ((count (hrt::receive-available fd buffer 0 (length buffer))))
    (if (not (and (integerp count) (plusp count)))
        (unless (eq count :would-block)
          (hrt::close-fd fd))
        (let ((close (search *floor-close-request-marker* buffer :end2 count)))
          (funcall answer buffer count)
          (let ((reply (if close close-reply keep-alive-reply)))
            (hrt::send-octets fd reply 0 (length reply)))
          (if close
              (hrt::close-fd fd)
              (hrt::epoll-rearm epoll-fd fd fd))))))

(defun run-floor-thread (epoll-fd listen-fd answer)
  "One thread of a floor: wait on EPOLL-FD, accept, or answer with ANSWER
(SERVE-FLOOR-CONNECTION), forever."
  (let ((buffer (make-array 4096 :element-type '(unsigned-byte 8)))
        (keep-alive-reply (floor-reply nil))
        (close-reply (floor-reply t)))
    (loop
      (let ((token (hrt::epoll-wait-one epoll-fd -1)))
        (cond ((not (integerp token)))
              ((= token listen-fd)
               (loop for fd = (hrt::accept-connection-fd listen-fd)
                     while fd
                     do (hrt::epoll-watch epoll-fd fd fd :trigger :one-shot))
               (hrt::epoll-rearm epoll-fd listen-fd listen-fd))
              (t (serve-floor-connection epoll-fd token buffer answer keep-alive-reply close-reply)))))))

(defun serve-floor (port name make-answer thread-count)
  "Serve a floor on 127.0.0.1:PORT with THREAD-COUNT threads named after
NAME, each answering requests with the function MAKE-ANSWER makes for it
(RUN-FLOOR-THREAD), until killed."
  (let* ((listen-socket (hrt::listen-on #(127 0 0 1) port 511))
         (listen-fd (hrt::socket-file-descriptor listen-socket))
         (epoll-fd (hrt::make-epoll-set)))
    (hrt::set-non-blocking listen-socket)
    (hrt::epoll-watch epoll-fd listen-fd listen-fd :trigger :one-shot)
    (dotimes (index thread-count)
      (bt:make-thread (lambda () (run-floor-thread epoll-fd listen-fd (funcall make-answer)))
                      :name (format nil "~A ~D" name index)))
    ;; The threads know the listening socket by its descriptor only: were
    ;; the socket collected, its finalizer would close that descriptor
    ;; under them (accept4 then fails with EBADF and the floor ends, as it
    ;; did in some 1 ms runs at 1,000 connections).  The cleanup keeps it.
    (unwind-protect (loop (sleep 3600))
      (usocket:socket-close listen-socket))))

(defun serve-threaded-floor (port &key (delay-ms 0) (thread-count (hrt::default-max-thread-count)))
  "Serve the threaded floor on 127.0.0.1:PORT with THREAD-COUNT threads
(Hunchentoot's default thread limit, which ours keeps), each handler
sleeping DELAY-MS, until killed."
  (let ((delay (and (plusp delay-ms) (/ delay-ms 1000))))
    (serve-floor port "threaded floor"
                 (lambda ()
                   (lambda (buffer count)
                     (declare (ignore buffer count))
                     (when delay
                       (sleep delay))))
                 thread-count)))

;;; Measured beside ours and nginx.

(defun launch-floor (form core log-file)
  "Start a floor from CORE in a process of its own, on *SERVER-PROCESSORS*,
serving by FORM (a string); its process-info."
  (uiop:launch-program
   (pinned-command
    (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
          "--eval" form))
   :output log-file :error-output :output :if-output-exists :supersede))

(defun launch-threaded-floor (port delay-ms core log-file)
  "Start the threaded floor (LAUNCH-FLOOR)."
  (launch-floor (format nil "(hunchentoot-recycling-taskmaster-bench::serve-threaded-floor ~D :delay-ms ~D)"
                        port delay-ms)
                core log-file))

(defparameter *threaded-floor-server*
  (list :name "threaded-floor"
        :label (format nil "threaded floor, ~D threads" (hrt::default-max-thread-count))
        :launch 'launch-threaded-floor))

(defun run-threaded-floor (&key core (rounds 3))
  "The 1 ms handler cells of the matrix for the threaded floor, ours and
nginx, round by round in one run: ours as a ratio to the floor, and each
as a fraction of nginx.  Writes bench/results/<UTC timestamp>-threaded-floor/."
  (flet ((server (name) (find name *servers* :key (lambda (server) (getf server :name)) :test #'string=)))
    (run-benchmarks :core core :peers nil :rounds rounds
                    :servers (list *threaded-floor-server* (server "parallel") (server "nginx"))
                    :workloads (remove-if-not (lambda (workload)
                                                (and (= 1 (getf workload :delay-ms)) (null (getf workload :file))))
                                              (workloads nil))
                    :run-name (format nil "~A-threaded-floor" (utc-timestamp)))))
