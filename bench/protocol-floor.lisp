;;;; The protocol floor: the threaded floor (threaded-floor.lisp) answering
;;;; each request through Hunchentoot's protocol as cheaply as ours does --
;;;; its head parsed (PARSE-REQUEST-HEAD), Hunchentoot's request and reply
;;;; made by ours' constructors, the easy handler /yo dispatched through
;;;; HUNCHENTOOT:HANDLE-REQUEST with *REPLY* and *SESSION* bound, the
;;;; reply's status, headers and body length read -- then the floor's fixed
;;;; reply sent.  No pool, no readiness engine, no reply head built, no
;;;; log.  It is what a drop-in server must do beyond the threaded floor,
;;;; on the floor's threads: a bound on ours' fraction of the threaded
;;;; floor with 1 ms handlers, to within the epoll_ctl a request that ours'
;;;; edge-triggered parking saves, which the per-core table measures with
;;;; both floors loaded at the same moment (MEASURE-PROTOCOL-FLOOR-LIMIT in
;;;; same-moment.lisp).  Its acceptor is never started: its easy handlers are
;;;; found through ours' index, Hunchentoot's dispatch their fallback.
;;;;
;;;; It answers as the threaded floor does: each read one whole GET.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defclass protocol-floor-acceptor (hrt::indexed-easy-handlers ht:easy-acceptor)
  ()
  (:documentation "The protocol floor's acceptor: Hunchentoot's easy acceptor
with ours' index of easy handlers, never started."))

(defconstant +protocol-floor-header-bytes+ 16384
  "The largest header block the protocol floor parses: ours' default
:MAX-HEADER-BYTES.")

(defun answer-through-protocol (acceptor constructors head addresses)
  "Make the request of HEAD, a REQUEST-HEAD, on a connection with ADDRESSES
and its reply, run its handler through HUNCHENTOOT:HANDLE-REQUEST, and read
what a reply head is built from; that reading's sum, so that it is made."
  (let* ((reply (hrt::make-reply constructors t))
         (ht:*reply* reply)
         (ht:*session* nil)
         (request (hrt::make-request constructors acceptor head addresses nil))
         (contents (ht:handle-request acceptor request)))
    (+ (ht:return-code reply) (length (ht:headers-out reply)) (length (ht:content-type reply))
       (length contents))))

(defun protocol-floor-answer (acceptor constructors)
  "A thread's answer for SERVE-FLOOR: the head in the octets read answered
through Hunchentoot's protocol (ANSWER-THROUGH-PROTOCOL), in the thread's
own REQUEST-HEAD and name scratch.  An incomplete head is only replied to."
  (let ((scratch (hrt::make-name-scratch))
        (head (hrt::make-request-head))
        (addresses (list "127.0.0.1" 0 "127.0.0.1" 0)))
    (lambda (buffer count)
      (multiple-value-bind (state request-start request-line-end head-end)
          (hrt::scan-request-head buffer 0 count +protocol-floor-header-bytes+)
        (when (eq state :complete)
          (answer-through-protocol acceptor constructors
                                   (hrt::parse-request-head buffer request-start request-line-end head-end
                                                            scratch head)
                                   addresses))))))

(defun serve-protocol-floor (port &key (delay-ms 0) (thread-count (hrt::default-max-thread-count)))
  "Serve the protocol floor on 127.0.0.1:PORT with THREAD-COUNT threads,
the /yo handler sleeping DELAY-MS, until killed."
  (let* ((acceptor (make-instance 'protocol-floor-acceptor :address "127.0.0.1" :port port
                                                           :access-log-destination nil))
         (constructors (hrt::make-object-constructors acceptor)))
    (setf *handler-delay* (and (plusp delay-ms) (/ delay-ms 1000)))
    (serve-floor port "protocol floor" (lambda () (protocol-floor-answer acceptor constructors)) thread-count)))

(defun launch-protocol-floor (port delay-ms core log-file)
  "Start the protocol floor (LAUNCH-FLOOR)."
  (launch-floor (format nil "(hunchentoot-recycling-taskmaster-bench::serve-protocol-floor ~D :delay-ms ~D)"
                        port delay-ms)
                core log-file))

(defparameter *protocol-floor-server*
  (list :name "protocol-floor"
        :label (format nil "protocol floor, ~D threads" (hrt::default-max-thread-count))
        :launch 'launch-protocol-floor))
