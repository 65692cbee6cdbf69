;;;; What a chunked request body costs the server: Hunchentoot's
;;;; easy-acceptor and ours, each in a process of its own, read bodies of
;;;; one-octet chunks (six octets of framing per octet of data, the worst a
;;;; client can send) from POST /body-length, and the server process's CPU
;;;; time (user and system, from /proc/PID/stat) is divided by the
;;;; megabytes of data.  The client is this process, which sends each whole
;;;; request with one write.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun one-octet-chunks-request (data-octets)
  "POST /body-length with a body of DATA-OCTETS one-octet chunks, as octets."
  (let* ((head (format nil "POST /body-length HTTP/1.1~C~CHost: localhost~C~CTransfer-Encoding: chunked~C~C~
                            Connection: close~C~C~C~C"
                       #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed
                       #\Return #\Linefeed))
         (chunk (map '(vector (unsigned-byte 8)) #'char-code (format nil "1~C~Cx~C~C" #\Return #\Linefeed
                                                                     #\Return #\Linefeed)))
         (last-chunk (map '(vector (unsigned-byte 8)) #'char-code (format nil "0~C~C~C~C" #\Return #\Linefeed
                                                                          #\Return #\Linefeed)))
         (octets (make-array (+ (length head) (* 6 data-octets) (length last-chunk))
                             :element-type '(unsigned-byte 8))))
    (replace octets (map '(vector (unsigned-byte 8)) #'char-code head))
    (loop for position from (length head) by 6
          repeat data-octets
          do (replace octets chunk :start1 position))
    (replace octets last-chunk :start1 (- (length octets) (length last-chunk)))
    octets))

(defun send-and-read-reply (port octets)
  "Send OCTETS to 127.0.0.1:PORT and read the reply to its end; the reply's
body, as a string, and its head."
  (let ((socket (usocket:socket-connect "127.0.0.1" port :element-type '(unsigned-byte 8))))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (write-sequence octets stream)
           (finish-output stream)
           (let ((reply (make-array 0 :element-type 'character :adjustable t :fill-pointer t)))
             (loop for octet = (read-byte stream nil)
                   while octet
                   do (vector-push-extend (code-char octet) reply))
             (let ((head-end (or (search (format nil "~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed)
                                         reply)
                                 (- (length reply) 4))))
               (values (subseq reply (+ 4 head-end)) (subseq reply 0 head-end)))))
      (usocket:socket-close socket))))

(defun chunked-body-cpu (server megabytes requests core)
  "Server CPU seconds per megabyte of one-octet-chunk data that SERVER (an
entry of *SERVERS*) spends reading REQUESTS bodies of MEGABYTES each."
  (let* ((port (free-port))
         (process (launch-server server port 0 core nil))
         (data-octets (* megabytes 1000 1000))
         (request (one-octet-chunks-request data-octets)))
    (unwind-protect
         (progn
           (wait-until-serving port)
           ;; Warm up: the first request makes the pool's threads.
           (send-and-read-reply port (one-octet-chunks-request 1000))
           (let ((before (process-cpu-seconds (uiop:process-info-pid process))))
             (dotimes (i requests)
               (let ((reply (send-and-read-reply port request)))
                 (unless (equal reply (princ-to-string data-octets))
                   (error "~A answered ~S for a body of ~D octets" (getf server :name) reply data-octets))))
             (/ (- (process-cpu-seconds (uiop:process-info-pid process)) before)
                (* megabytes requests))))
      (stop-server process))))

(defun run-chunked-body-cost (&key (megabytes 1) (requests 5) (rounds 3) core)
  "Print the server CPU seconds per MB of one-octet chunks for Hunchentoot
and ours, ROUNDS rounds of REQUESTS bodies of MEGABYTES each, side by side,
and the median ratio.  True when ours costs at most Hunchentoot's."
  (let* ((servers (list (first *servers*) (second *servers*)))
         (rounds (loop for round from 1 to rounds
                       collect (mapcar (lambda (server) (chunked-body-cpu server megabytes requests core))
                                       servers)))
         (ratios (sort (mapcar (lambda (round) (/ (second round) (first round))) rounds) #'<))
         (median (nth (floor (length ratios) 2) ratios)))
    (format t "~&Chunked request bodies of one-octet chunks: server CPU seconds per MB of data~%~
               (~D request~:P of ~D MB a round, each server in its own process)~%~%~
               | round | ~A | ~A | ours / Hunchentoot |~%|---|---:|---:|---:|~%"
            requests megabytes (getf (first servers) :label) (getf (second servers) :label))
    (loop for (theirs ours) in rounds
          for round from 1
          do (format t "| ~D | ~,3F | ~,3F | ~,2F |~%" round theirs ours (/ ours theirs)))
    (format t "~%Median ratio: ~,2F (at most 1.00: ours costs no more than Hunchentoot's)~%" median)
    (<= median 1)))
